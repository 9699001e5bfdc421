"""Any pytorch-metric-learning (PML) loss, and optionally a PML miner, chosen by class name in the recipe:

    loss_type: pml
    pml_loss: MultiSimilarityLoss
    pml_arguments: {alpha: 2, beta: 50, base: 0.5}
    miner: MultiSimilarityMiner
    miner_arguments: {epsilon: 0.1}

The names and arguments are checked against the installed library's classes with the recipe, before any weight is
read (an unknown name or argument, or a required one missing, is one line naming the key). `num_classes` and the
embedding size (`embedding_size`, `descriptors_dim`) of proxy and class-centre losses are filled from the training
data and the model, as sub-center ArcFace's are. A `distance`,
`reducer` or `*_regularizer` argument given as a name is that PML class built with its defaults.

Computed as every metric-learning loss here (vembed/classification/metric_losses.py): on the global batch gathered from
every rank, so 2 ranks train as one process on the whole batch; the miner runs on that global batch too, so it picks
the pairs one process would. A loss's own parameters (proxies, centres) are trained, checkpointed and saved in
final/'s loss.safetensors like ArcFace's centres. The registry is one entry and not one per class: PML is an optional
extra, so its class list is read from the installed library, not written out here.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field, model_validator

from vembed.classification import METRIC_LOSSES
from vembed.classification.metric_losses import MetricLoss, MetricLossSettings, pml_losses
from vembed.errors import RecipeError, did_you_mean
from vembed.recipe import InvalidKey

if TYPE_CHECKING:
    from vembed.recipe import Recipe

# PML classes a recipe cannot name, and why: bases, and losses whose inputs are not (embeddings, class labels).
NOT_SELECTABLE = {
    "BaseMetricLossFunction": "a base class, not a loss",
    "GenericPairLoss": "a base class, not a loss",
    "VICRegLoss": "self-supervised: it takes two views' embeddings and no labels (use ntxent with positives: views)",
    "ManifoldLoss": "it takes no labels (an unsupervised loss on the embeddings' manifold)",
}
# Losses that need every class of a batch equally often: class-balanced batches (data.m_per_class) give that.
EQUAL_CLASS_COUNTS = ("SmoothAPLoss",)
# Constructor arguments vembed fills: the classes of data.train, and the size of the model's embeddings.
FROM_THE_DATA = ("num_classes",)
FROM_THE_MODEL = ("embedding_size", "descriptors_dim")
# Arguments PML's own subclasses pass to their bases (never a user's), and PML's bookkeeping switch.
INTERNAL = {"mat_based_loss", "collect_stats"}
# Arguments that take a PML object, built from its class name: argument -> PML module holding the classes.
OBJECT_ARGUMENTS = {"distance": "distances", "reducer": "reducers"}
REGULARIZER_SUFFIX = "_regularizer"


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"pytorch_metric_learning.{name}")


def selectable_losses() -> dict[str, type]:
    """The PML loss classes a recipe can name, by class name (the installed PML's)."""
    losses = pml_losses("pml")
    base = losses.BaseMetricLossFunction
    return {name: value for name, value in sorted(vars(losses).items())
            if inspect.isclass(value) and issubclass(value, base) and name not in NOT_SELECTABLE}


def selectable_miners() -> dict[str, type]:
    miners = _module("miners")
    return {name: value for name, value in sorted(vars(miners).items())
            if inspect.isclass(value) and issubclass(value, miners.BaseMiner) and name != "BaseMiner"}


def constructor_arguments(cls: type) -> tuple[set[str], list[str]]:
    """(every keyword the class's constructor takes, by name; the ones it requires). PML passes `**kwargs` up its
    bases (reducer, distance, regularizers), so the keywords are those of every `__init__` up the chain; the required
    ones are those of the first `__init__` that does not pass positional arguments (`*args`) on to its base."""
    accepted: set[str] = set()
    required: list[str] | None = None
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            break
        init = vars(klass).get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]
        named = [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        for parameter in named:
            if parameter.name not in INTERNAL:
                accepted.add(parameter.name)
        if required is None and not any(p.kind is p.VAR_POSITIONAL for p in parameters):
            required = [p.name for p in named if p.default is inspect.Parameter.empty and p.name not in INTERNAL]
    return accepted, required or []


def argument_problem(key: str, cls: type, given: dict[str, Any], filled: tuple[str, ...]) -> tuple[str, str] | None:
    """(key, what is wrong) for an argument `cls` does not take, one vembed fills, or a required one not given."""
    accepted, required = constructor_arguments(cls)
    for name in given:
        if name not in accepted:
            choices = ", ".join(sorted(set(accepted) - set(filled)))
            return f"{key}.{name}", (f"{cls.__name__} takes no argument {name!r}{did_you_mean(name, accepted)}; it "
                                     f"takes: {choices}")
        if name in filled:
            return f"{key}.{name}", "is filled by vembed (the training classes, the model's embedding size); remove it"
    missing = [name for name in required if name not in given and name not in filled]
    if missing:
        return key, f"{cls.__name__} requires {', '.join(missing)}; give them, e.g. {key}.{missing[0]}=<value>"
    return None


def name_problem(name: str, choices: dict[str, type], kind: str) -> str | None:
    """What is wrong with a class name a recipe gives, or None."""
    if name in choices:
        return None
    if name in NOT_SELECTABLE:
        return f"{name!r} cannot be used: {NOT_SELECTABLE[name]}"
    return f"{name!r} is not a {kind}" + (did_you_mean(name, choices) or f"; one of: {', '.join(choices)}")


class PMLSettings(MetricLossSettings):
    # The pytorch-metric-learning loss class, by name (e.g. MultiSimilarityLoss, ProxyAnchorLoss, CircleLoss).
    pml_loss: str
    pml_arguments: dict[str, Any] = Field(default_factory=dict)  # the loss class's keyword arguments
    # A pytorch-metric-learning miner class (e.g. MultiSimilarityMiner, TripletMarginMiner): it picks which pairs or
    # triplets of the batch the loss counts. None: every pair.
    miner: str | None = None
    miner_arguments: dict[str, Any] = Field(default_factory=dict)  # the miner class's keyword arguments
    num_classes: int | None = Field(default=None, gt=0)  # classes of a proxy loss (unset: data.train's)

    @model_validator(mode="after")
    def _miner_arguments_need_a_miner(self) -> "PMLSettings":
        if self.miner is None and self.miner_arguments:
            raise InvalidKey("miner_arguments", "are given but miner is not; set miner or remove them")
        return self


def _built(cls: type, arguments: dict[str, Any]) -> Any:
    """`cls(**arguments)`, with a distance, reducer or regularizer given by class name built from it."""
    objects = {}
    for name, value in arguments.items():
        module = OBJECT_ARGUMENTS.get(name) or ("regularizers" if name.endswith(REGULARIZER_SUFFIX) else None)
        objects[name] = getattr(_module(module), value)() if module and isinstance(value, str) else value
    return cls(**objects)


@METRIC_LOSSES.register("pml")
class PMLLoss(MetricLoss):
    """A PML loss (and miner) named in the recipe, on the global batch. `self.loss` is the PML loss itself."""

    Settings: ClassVar[type[PMLSettings]] = PMLSettings

    def __init__(self, pml_loss: str, pml_arguments: dict[str, Any] | None = None, miner: str | None = None,
                 miner_arguments: dict[str, Any] | None = None, num_classes: int | None = None,
                 embedding_dim: int | None = None):
        super().__init__()
        loss_cls = selectable_losses()[pml_loss]
        accepted, _ = constructor_arguments(loss_cls)
        filled = {name: num_classes for name in FROM_THE_DATA if name in accepted}
        filled |= {name: embedding_dim for name in FROM_THE_MODEL if name in accepted}
        # What rebuilds the loss from final/'s loss.safetensors (vembed/losses/saved_state.py): these arguments.
        self.settings = {"pml_loss": pml_loss, "pml_arguments": dict(pml_arguments or {}), "miner": miner,
                         "miner_arguments": dict(miner_arguments or {}), "num_classes": num_classes,
                         "embedding_dim": embedding_dim}
        self.loss = _built(loss_cls, {**self.settings["pml_arguments"], **filled})
        self.miner = _built(selectable_miners()[miner], self.settings["miner_arguments"]) if miner else None

    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        """The class names against the installed library, and their arguments against the classes' constructors."""
        settings = recipe.loss
        losses = selectable_losses()
        problem = name_problem(settings.pml_loss, losses, "pytorch-metric-learning loss")
        if problem:
            raise RecipeError("pml_loss", problem)
        if settings.pml_loss in EQUAL_CLASS_COUNTS and not recipe.data.m_per_class:
            raise RecipeError("pml_loss", f"{settings.pml_loss} needs the same number of images of every class in a "
                                          "batch; set data.m_per_class (class-balanced batches)")
        problem = argument_problem("pml_arguments", losses[settings.pml_loss], settings.pml_arguments,
                                   FROM_THE_DATA + FROM_THE_MODEL)
        if problem:
            raise RecipeError(*problem)
        if settings.miner is None:
            return
        miners = selectable_miners()
        problem = name_problem(settings.miner, miners, "pytorch-metric-learning miner")
        if problem:
            raise RecipeError("miner", problem)
        problem = argument_problem("miner_arguments", miners[settings.miner], settings.miner_arguments, ())
        if problem:
            raise RecipeError(*problem)

    @classmethod
    def proxies_of(cls, settings: PMLSettings) -> bool:
        """Whether the loss holds a state per class (proxies, centres): it is then built with the classes' count."""
        return any(name in constructor_arguments(selectable_losses()[settings.pml_loss])[0] for name in FROM_THE_DATA)

    @classmethod
    def from_recipe(cls, recipe: "Recipe", *, num_classes: int | None = None,
                    embedding_dim: int | None = None) -> "PMLLoss":
        settings = recipe.loss
        num_classes = num_classes or settings.num_classes
        if cls.proxies_of(settings) and num_classes is None:
            raise RecipeError("num_classes", f"{settings.pml_loss} holds a proxy per class: set num_classes, or "
                                             "point data.train at the labelled images")
        if embedding_dim is None:  # the callers (the task, the planner) know the adapter's size
            raise TypeError("a PML loss needs the embedding_dim of the model it trains")
        return cls(settings.pml_loss, settings.pml_arguments, settings.miner, settings.miner_arguments,
                   num_classes=num_classes, embedding_dim=embedding_dim)

    @classmethod
    def positives_needed(cls, settings: PMLSettings) -> bool:
        return not cls.proxies_of(settings)  # a proxy loss pulls each image towards its class's proxy

    @property
    def config(self) -> dict[str, Any]:
        return {"name": self.settings["pml_loss"], **self.settings}

    def class_scores(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Each embedding's cosine to each class's weights, for the losses whose class weights PML scores so
        (ArcFace, CosFace, SphereFace, normalised softmax: `get_cosine`)."""
        if not hasattr(self.loss, "get_cosine"):
            return super().class_scores(embeddings)
        with torch.no_grad():
            return self.loss.get_cosine(embeddings.float().to(self.loss.W.device))

    def global_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.miner is None:
            return self.loss(embeddings, labels)
        return self.loss(embeddings, labels, self.miner(embeddings, labels))  # mined on the global batch


__all__ = ["NOT_SELECTABLE", "PMLLoss", "PMLSettings", "argument_problem", "constructor_arguments", "name_problem",
           "selectable_losses", "selectable_miners"]
