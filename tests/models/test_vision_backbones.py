"""model_type vision over transformers' CNN and hierarchical backbones (ConvNeXt v1/v2, ResNet, EfficientNet, Swin
v1/v2): each family's pooling reads the right output, a classification step trains every parameter it reaches, the
saved folder round-trips (and loads with AutoModel alone); stochastic depth sets the family's drop-path key; what is
refused is refused in one line."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VISION_BACKBONE_WIDTHS, VISION_BACKBONES
from training_digits import digits_recipe, write_digit_splits

from tests.models.conftest import NO_DROPOUT, SMALL_VISION

FAMILIES = sorted(VISION_BACKBONES)
FEATURE_MAPS = {"convnext", "convnextv2", "resnet", "efficientnet"}  # (B, C, H, W); Swin gives (B, N, C) tokens
# Every family vembed lists, each with its own pooling, as the recipe may set it: gradients must reach every
# trainable parameter (DDP fails on one that gets none).
ALL_FAMILIES = {**VISION_BACKBONES, "vit": {"model_type": "vit", **SMALL_VISION, **NO_DROPOUT},
                "dinov2": {"model_type": "dinov2", **SMALL_VISION, **NO_DROPOUT},
                "clip_vision_model": {"model_type": "clip_vision_model", **SMALL_VISION},
                "siglip_vision_model": {"model_type": "siglip_vision_model", **SMALL_VISION}}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_splits(tmp_path_factory.mktemp("digits"))


def _adapter(recipe_for, config, **settings):
    from vembed.models import MODELS

    torch.manual_seed(0)
    return MODELS.get("vision").from_recipe(recipe_for("vision", model_config=config, **settings)).eval()


def _tokens(hidden: torch.Tensor, model_type: str) -> torch.Tensor:
    """(B, positions, C): a feature map's spatial positions, or Swin's tokens."""
    return hidden.flatten(2).transpose(1, 2) if model_type in FEATURE_MAPS else hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_pools_its_own_output_mean_and_gem_over_positions(recipe_for, image_sides, family):
    from vembed.models import MODELS

    config = VISION_BACKBONES[family]
    recipe = recipe_for("vision", model_config=config, projection_dim=None)
    assert MODELS.get("vision").embedding_dim_for(recipe) == VISION_BACKBONE_WIDTHS[family]  # from the config alone
    for pooling in (None, "pooler", "mean", "gem"):
        adapter = _adapter(recipe_for, config, pooling=pooling, projection_dim=None, normalize=False, gem_p=2.0)
        assert adapter.settings.pooling == (pooling or "pooler")  # the family's own when unset
        assert adapter.embedding_dim == VISION_BACKBONE_WIDTHS[family]
        inputs = adapter.preprocess(image_sides)
        with torch.no_grad():
            output = adapter.model(pixel_values=inputs["pixel_values"])
            tokens = _tokens(output.last_hidden_state, family)
            expected = {"pooler": output.pooler_output.flatten(1), "mean": tokens.mean(1),
                        "gem": tokens.clamp(min=1e-6).pow(2).mean(1).sqrt()}[pooling or "pooler"]
            assert expected.shape == (len(image_sides), VISION_BACKBONE_WIDTHS[family])
            torch.testing.assert_close(adapter.encode(inputs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
def test_every_trainable_parameter_gets_a_gradient_under_each_pooling(recipe_for, image_sides, family):
    """Modules only the pooled output passes through (ViT's pooler, CLIP's post_layernorm, SigLIP's head, ConvNeXt's
    final norm) are frozen when the pooling does not read it, and only then; so is DINOv2's mask token."""
    poolings = ("pooler", "mean", "gem") + (() if family in VISION_BACKBONES else ("cls",))
    for pooling in poolings:
        adapter = _adapter(recipe_for, ALL_FAMILIES[family], pooling=pooling).train()
        adapter.classify(adapter.preprocess(image_sides)).sum().backward()
        starved = [n for n, p in adapter.named_parameters() if p.requires_grad and p.grad is None]
        assert not starved, (pooling, starved)
        frozen = [n for n, p in adapter.named_parameters() if not p.requires_grad]
        if pooling == "pooler":  # all it reaches trains; DINOv2's mask token is for masked-image modelling only
            assert frozen == (["model.embeddings.mask_token"] if family == "dinov2" else [])


def _one_training_step(raw: dict):
    """The adapter after one optimiser step of the classification task on 6 digits (through the trainer, as a run
    takes it), and the gradients of that step."""
    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = trainer.loader.collate_fn([trainer.dataset[i] for i in (0, 1, 12, 13, 24, 25)])
    loss = trainer.train_step(send_to_device(batch, trainer.accelerator.device))
    objective = trainer.accelerator.unwrap_model(trainer.model)
    grads = {n: p.grad for n, p in objective.named_parameters() if p.requires_grad}
    trainer.optimizer.step()
    return objective.adapter.eval(), loss.item(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_a_classification_step_trains_and_the_saved_folder_round_trips(digits, tmp_path, image_sides, family):
    from transformers import AutoModel

    from vembed.models import load_adapter

    raw = digits_recipe(digits, tmp_path / "run", model_config=VISION_BACKBONES[family], projection_dim=8)
    adapter, loss, grads = _one_training_step(raw)
    assert torch.isfinite(torch.tensor(loss)) and loss > 0
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), family
    assert any(g.abs().sum() > 0 for n, g in grads.items() if n.startswith("adapter.model."))

    adapter.save(tmp_path / "saved")
    loaded = load_adapter(tmp_path / "saved").eval()
    assert loaded.settings.pooling == "pooler" and loaded.settings.label_names == ["one", "two", "zero"]
    inputs = adapter.preprocess(image_sides)
    with torch.no_grad():
        torch.testing.assert_close(loaded.classify(inputs), adapter.classify(inputs), atol=1e-6, rtol=0)
        # The backbone folder is plain transformers: AutoModel alone gives the pooled features the adapter reads.
        plain = AutoModel.from_pretrained(tmp_path / "saved").eval()
        pooled = plain(pixel_values=inputs["pixel_values"]).pooler_output.flatten(1)
        torch.testing.assert_close(pooled, adapter.pool(adapter.model(pixel_values=inputs["pixel_values"]),
                                                        "pooler"), atol=1e-6, rtol=0)


STOCHASTIC_DEPTH = {"convnext": "drop_path_rate", "efficientnet": "drop_connect_rate", "swin": "drop_path_rate",
                    "dinov2": "drop_path_rate"}


@pytest.mark.parametrize("family", sorted(STOCHASTIC_DEPTH))
def test_stochastic_depth_drops_paths_in_training_only(recipe_for, image_sides, family):
    config = ALL_FAMILIES[family]
    for rate in (0.5, 0.0):
        adapter = _adapter(recipe_for, config, stochastic_depth=rate)
        assert getattr(adapter.model.config, STOCHASTIC_DEPTH[family]) == rate
        inputs = adapter.preprocess(image_sides)
        with torch.no_grad():
            assert torch.equal(adapter.encode(inputs), adapter.encode(inputs))  # eval: no drop
            adapter.train()
            torch.manual_seed(1)
            first, second = adapter.encode(inputs), adapter.encode(inputs)
        assert torch.equal(first, second) == (rate == 0), (family, rate)


def test_stochastic_depth_is_set_on_a_pretrained_backbone_and_its_processor_loads_without_the_hub(recipe_for,
                                                                                                   tmp_path):
    """A checkpoint folder as the hub ships them (ConvNeXt's and EfficientNet's own processors): built from
    model_name with the recipe's rate, its processor read with the PIL backend (no torchvision)."""
    from transformers import AutoConfig, AutoModel, ConvNextImageProcessorPil, EfficientNetImageProcessorPil

    from vembed.models import MODELS

    for family, processor in (("convnext", ConvNextImageProcessorPil), ("efficientnet",
                                                                        EfficientNetImageProcessorPil)):
        folder = tmp_path / family
        config = dict(VISION_BACKBONES[family])
        AutoModel.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).save_pretrained(folder)
        processor(size={"height": 32, "width": 32}).save_pretrained(folder)
        recipe = recipe_for("vision", model_config=None, model_name=str(folder), stochastic_depth=0.3)
        adapter = MODELS.get("vision").from_recipe(recipe)
        assert getattr(adapter.model.config, STOCHASTIC_DEPTH[family]) == 0.3
        assert type(adapter.image_processor) is processor


@pytest.mark.parametrize("config, settings, message", [
    (VISION_BACKBONES["convnext"], {"pooling": "cls"},
     r"pooling: cls reads a CLS token, which 'convnext' models do not have; use pooler \(the layer-normed global "
     r"average\), mean or gem"),
    (VISION_BACKBONES["resnet"], {"stochastic_depth": 0.1},
     r"stochastic_depth: sets a drop-path rate, which 'resnet' models do not have; remove it"),
    (ALL_FAMILIES["vit"], {"stochastic_depth": 0.1}, r"stochastic_depth: .*'vit' models do not have"),
    (VISION_BACKBONES["swin"], {"stochastic_depth": 1.5}, r"stochastic_depth"),
], ids=["cls_on_convnext", "stochastic_depth_on_resnet", "stochastic_depth_on_vit", "stochastic_depth_1.5"])
def test_what_a_family_cannot_do_is_refused_in_one_line(recipe_for, config, settings, message):
    import re

    from vembed.errors import RecipeError

    with pytest.raises(RecipeError) as error:
        _adapter(recipe_for, config, **settings)
    assert len(str(error.value).splitlines()) == 1 and re.search(message, str(error.value)), str(error.value)


def test_a_config_that_is_no_vision_backbone_names_the_families(recipe_for):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match="'bit' is not a vision backbone; name one \\(vit, .*convnext.*swinv2"):
        _adapter(recipe_for, {"model_type": "bit"})
