"""The model card: a README.md a person can read, rendered from what a run recorded (`card.json`, kept beside it in the
saved folder), so that `vembed export` and a later re-rendering need only the model folder, never the run directory.

`card.json` holds the facts (base model, resolved recipe, data counts, launch, training length, metrics, plot files);
`render_card` turns them into Markdown with Hugging Face's YAML front matter. The card renders whatever metric names
the run recorded: evaluation adds metrics without this module knowing them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from vembed.files import replace_atomically

CARD_FILE = "card.json"
README_FILE = "README.md"
CARD_FORMAT = 1
SPLITS = ("train", "validation", "test")
EVAL_COLUMNS = (("before", "before training (validation)"), ("validation", "validation"), ("test", "test"))
PLOT_CAPTIONS = {
    "loss_curve.png": "training loss (and the validation metric, when evaluated during training)",
    "accuracy_vs_dim.png": "accuracy@k (a relevant document in the top k) at each Matryoshka dimension",
    "recall_vs_dim.png": "accuracy@k at each Matryoshka dimension",  # its name in runs before issue 23
    "similarity_histogram.png": "per-image cosine of generated to real embeddings",
}
# Two texts of different lengths: the snippets then show padding handled as vembed handles it.
EXAMPLE_TEXTS = ["a photo of a cat", "two dogs playing in the snow near a red house"]
Flavour = Literal["vembed", "sentence-transformers"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# --- the facts -------------------------------------------------------------------------------------------------------


def _vembed_version() -> str:
    # From the installed metadata: importing the `vembed` package object from here would reach above this layer.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vembed")
    except PackageNotFoundError:
        return "unknown"


def build_card(recipe: dict[str, Any], *, adapter_info: Mapping[str, Any], launch: dict[str, Any],
               data: dict[str, Any], metrics: Mapping[str, Any], plots: Sequence[str]) -> dict[str, Any]:
    """The card's facts (what `card.json` holds). `recipe`: the resolved recipe (`Recipe.to_dict()`);
    `adapter_info`: what the saved folder's `vembed.json` holds (model_type, embedding_dim, the adapter's resolved
    settings); `launch`: the start block's figures (`vembed.training.start_block.launch_record`); `data`: split ->
    what was read of it (the data reports' `to_dict()`); `metrics`: the run's metrics.json; `plots`: PNG file names
    of the run's plots."""
    train = dict(metrics.get("train") or {})
    train.pop("data", None)  # kept under `data`
    return {
        "format": CARD_FORMAT,
        "vembed_version": _vembed_version(),
        "model": {**_model_facts(adapter_info), "base": base_models(recipe)},
        "recipe": recipe,
        "data": data,
        "launch": launch,
        "training": {**train, "max_steps": recipe.get("max_steps"), "epochs": recipe.get("epochs"),
                     "stages": len(recipe.get("stages") or ()) or None},
        "evaluation": {name: dict(metrics[name]) for name, _ in EVAL_COLUMNS if metrics.get(name)},
        "best": metrics.get("best"),
        "plots": list(plots),
    }


def base_models(recipe: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Where each tower's weights came from: `{"key": "model_name", "pretrained": "org/name"}` for pretrained
    weights, `{"key": "model_config", "config": {...}}` for a random init from a config (composed models name two)."""
    found = []
    for key, value in recipe.items():
        if value is None or not key.endswith(("model_name", "model_config")) or key.startswith("tokenizer"):
            continue
        found.append({"key": key, "pretrained": value} if key.endswith("model_name") else {"key": key, "config": value})
    return found


def _model_facts(info: Mapping[str, Any]) -> dict[str, Any]:
    return {"model_type": info.get("model_type"), "embedding_dim": info.get("embedding_dim"),
            "settings": dict(info.get("settings") or {})}


def read_card(folder: str | Path) -> dict[str, Any] | None:
    path = Path(folder, CARD_FILE)
    return json.loads(path.read_text()) if path.is_file() else None


def folder_card(folder: str | Path) -> dict[str, Any]:
    """The facts of a saved folder: its `card.json`, or (a folder saved outside a training run) what its
    `vembed.json` says."""
    card = read_card(folder)
    if card is not None:
        return card
    from vembed.models.base import read_adapter_file

    info = read_adapter_file(folder)
    return {"format": CARD_FORMAT, "model": _model_facts(info), "plots": []}


def write_card(folder: str | Path, card: dict[str, Any], *, plots_from: str | Path | None = None,
               flavour: Flavour = "vembed", load_path: str | None = None, source_path: str | None = None) -> Path:
    """Write `card.json`, README.md and the card's plots (copied from `plots_from`, else already in `folder`) into
    `folder`. The card is rendered before anything is written, and each file is written under a temporary name and
    renamed, so a folder never holds half a card. `load_path`: the path the card's snippets load (default: `folder`)."""
    folder = Path(folder)
    plots = [name for name in card.get("plots") or () if Path(plots_from or folder, name).is_file()]
    card = {**card, "plots": plots}
    text = render_card(card, flavour=flavour, load_path=load_path or str(folder), source_path=source_path)
    if plots_from is not None:
        for name in plots:
            replace_atomically(folder / name, lambda tmp, name=name: shutil.copyfile(Path(plots_from, name), tmp))
    replace_atomically(folder / CARD_FILE, lambda tmp: tmp.write_text(json.dumps(card, indent=2)))
    replace_atomically(folder / README_FILE, lambda tmp: tmp.write_text(text))
    return folder / README_FILE


def remove_card(folder: str | Path) -> None:
    """Remove what `write_card` may have written into `folder` (a card that failed half-way)."""
    for path in (Path(folder, README_FILE), Path(folder, CARD_FILE), *Path(folder).glob("*.png")):
        path.unlink(missing_ok=True)


# --- rendering -------------------------------------------------------------------------------------------------------


def render_card(card: Mapping[str, Any], *, flavour: Flavour = "vembed", load_path: str = ".",
                source_path: str | None = None) -> str:
    """The README.md of a saved folder (`flavour="vembed"`: a vembed model folder such as final/) or of its
    sentence-transformers export (`source_path`: the vembed folder it was exported from)."""
    model = card.get("model") or {}
    parts = [
        _front_matter(card, flavour),
        _title(card, flavour, source_path),
        _base_section(model, recorded="recipe" in card),
        _late_interaction_section(model),
        _data_section(card.get("data")),
        _launch_section(card.get("launch")),
        _training_section(card.get("training"), card.get("recipe")),
        # A folder saved outside a run has no record of any evaluation, not "no evaluation".
        _evaluation_section(card.get("evaluation"), card.get("best"), _source_names(card))
        if card.get("evaluation") or "recipe" in card else "",
        _plots_section(card.get("plots")),
        _load_section(model, flavour, load_path, source_path),
        _recipe_section(card.get("recipe")),
    ]
    return "\n\n".join(part for part in parts if part).rstrip() + "\n"


def _adapter_class(model_type: str | None) -> Any:
    from vembed.models import MODELS

    return MODELS.get(model_type) if model_type in MODELS else None


def _reranker_class(model_type: str | None) -> Any:
    """The reranker class (vembed/reranking, its own registry) of a folder that scores pairs; None for embedders."""
    from vembed.reranking import RERANKERS

    return RERANKERS.get(model_type) if model_type in RERANKERS else None


def _modalities(model_type: str | None) -> frozenset[str]:
    adapter = _adapter_class(model_type) or _reranker_class(model_type)
    return adapter.modalities if adapter is not None else frozenset()


def _multi_vector(model: Mapping[str, Any]) -> bool:
    """Whether the model gives token vectors (ColBERT, ColQwen), which no sentence-transformers model or pooling
    reproduces."""
    return (model.get("settings") or {}).get("embedding") == "multi_vector"


def _sparse(model: Mapping[str, Any]) -> bool:
    """Whether the model gives sparse vocabulary-sized vectors (SPLADE), whose folder loads in sentence-transformers
    as it is (`SparseEncoder(path)`): no export."""
    return (model.get("settings") or {}).get("embedding") == "sparse"


def _static_queries(model: Mapping[str, Any]) -> bool:
    """Whether a sparse model encodes queries with static weights (inference-free SPLADE): queries and documents are
    then encoded apart, by role (sentence-transformers: encode_query / encode_document)."""
    return (model.get("settings") or {}).get("query_encoder") == "static"


def _token_vectors_of(model: Mapping[str, Any]) -> Any:
    """The adapter class of a multi_vector model (its card facts: `vembed.models.token_projection.TokenVectors`)."""
    from vembed.models.token_projection import TokenVectors

    adapter = _adapter_class(model.get("model_type"))
    return adapter if adapter is not None and issubclass(adapter, TokenVectors) else TokenVectors


def _exportable(model: Mapping[str, Any]) -> bool:
    adapter = _adapter_class(model.get("model_type"))
    return (adapter is not None and adapter.has_sentence_transformers_equivalent() and not _multi_vector(model)
            and not _sparse(model))


def _front_matter(card: Mapping[str, Any], flavour: Flavour) -> str:
    model = card.get("model") or {}
    model_type = model.get("model_type")
    modalities = _modalities(model_type)
    tags = ["vembed", str(model_type), "feature-extraction"]
    if _multi_vector(model):
        tags += list(_token_vectors_of(model).card_tags)  # what the Hub lists late-interaction models under
    if flavour == "sentence-transformers" or _exportable(model) or _sparse(model):
        tags.insert(1, "sentence-transformers")
    if _sparse(model):
        tags += ["sparse-encoder", "sparse", "splade"]  # what the Hub lists sentence-transformers' sparse models under
    if modalities == {"text"}:
        tags.append("sentence-similarity")
    if "image" in modalities:
        tags.append("image-feature-extraction")
    meta: dict[str, Any] = {}
    reranker = _reranker_class(model_type)
    if reranker is not None:  # scores pairs: what the Hub lists rerankers under, and the library that loads it
        tags = ["vembed", *reranker.card_tags, str(model_type), "reranker", "text-ranking"]
        meta.update(library_name=reranker.card_library, pipeline_tag="text-ranking")
    elif flavour == "sentence-transformers" or _sparse(model):
        meta["library_name"] = "sentence-transformers"
        meta["pipeline_tag"] = "sentence-similarity" if modalities == {"text"} else "feature-extraction"
    else:
        meta["library_name"] = "transformers" if _transformers_example(model, ".") else "vembed"
        meta["pipeline_tag"] = "feature-extraction"
    meta["tags"] = list(dict.fromkeys(tags))
    # Hugging Face links base_model to a Hub repository: local paths (absolute, or ./, ../) are not named there.
    pretrained = [base["pretrained"] for base in model.get("base") or ()
                  if "pretrained" in base and _HUB_ID.match(str(base["pretrained"]))]
    if pretrained:
        meta["base_model"] = pretrained[0] if len(pretrained) == 1 else pretrained
    return "---\n" + yaml.safe_dump(meta, sort_keys=False).rstrip() + "\n---"


def _title(card: Mapping[str, Any], flavour: Flavour, source_path: str | None) -> str:
    model = card.get("model") or {}
    recipe = card.get("recipe") or {}
    name = recipe.get("run_name") or (Path(recipe["output_dir"]).name if recipe.get("output_dir") else None)
    reranker = _reranker_class(model.get("model_type")) is not None
    kind = f"{model.get('model_type')} {'reranker' if reranker else 'embedding model'}"
    title = f"# {name}: a vembed {kind}" if name else f"# A vembed {kind}"
    lines = [title, ""]
    dim = model.get("embedding_dim")
    normalized = {True: ", L2-normalised", False: ", not normalised"}.get(
        (model.get("settings") or {}).get("normalize"), "")
    what = f"Embeddings of {dim} dimensions{normalized}" if dim else "A model"
    if reranker:
        what = "One relevance score (a logit: higher ranks first) per (query, document) pair read jointly"
    if _sparse(model):
        what = f"Sparse vectors (SPLADE: one weight per vocabulary token) of {dim} dimensions{normalized}"
    if _multi_vector(model):
        what = (f"Token vectors ({_token_vectors_of(model).late_interaction_name} late interaction) of {dim} "
                f"dimensions{normalized}")
    modalities = " and ".join(sorted(_modalities(model.get("model_type")))) or "its inputs"
    training = card.get("training") or {}
    if training.get("steps") is not None:
        lines.append(f"{what} for {modalities}, fine-tuned with vembed for "
                     f"{training['steps']} optimizer steps (vembed {card.get('vembed_version', '?')}).")
    else:
        lines.append(f"{what} for {modalities}, saved by vembed. No training record came with this folder "
                     f"({CARD_FILE}), so the card holds only what the folder itself says.")
    if flavour == "sentence-transformers":
        lines.append("")
        lines.append("This folder is the sentence-transformers export"
                     + (f" of the vembed model folder `{source_path}`" if source_path else "")
                     + "; it embeds as vembed does (checked on probe inputs to 1e-5 when it was exported).")
    return "\n".join(lines)


def _base_section(model: Mapping[str, Any], recorded: bool) -> str:
    bases = model.get("base") or []
    lines = ["## Base model", "", f"- adapter: `{model.get('model_type')}`"]
    if model.get("embedding_dim"):
        lines.append(f"- embedding size: {model['embedding_dim']}")
    for base in bases:
        if "pretrained" in base:
            lines.append(f"- `{base['key']}`: `{base['pretrained']}` (pretrained weights)")
        else:
            config = base["config"]
            kind = config.get("model_type") if isinstance(config, dict) else None
            lines.append(f"- `{base['key']}`: random init from config" + (f" (`{kind}`)" if kind else "")
                         + " (the config is in the recipe below)")
    if not bases:
        lines.append("- weights: random init from the recipe's sizes (below)" if recorded else
                     "- weights: where they came from is not recorded in this folder")
    return "\n".join(lines)


def _late_interaction_section(model: Mapping[str, Any]) -> str:
    """What a multi-vector model's scores depend on besides its weights (the adapter's `card_rows`)."""
    if not _multi_vector(model):
        return ""
    rows = [
        ["token vector size", model.get("embedding_dim")],
        ["score", "MaxSim: the sum over query tokens of the best dot product with any document token"],
        *_token_vectors_of(model).card_rows(model.get("settings") or {}),
    ]
    return "## Late interaction\n\n" + _table(["setting", "value"], rows)


def _pylate_lines(path: str) -> list[str]:
    """Loading the folder in PyLate (vembed writes its files: `vembed/models/pylate_folder.py`)."""
    return ["With PyLate (`pip install pylate`), which reads the prefixes, lengths and skip-list from the folder:", "",
            "```python", "from pylate import models", "from pylate.scores import colbert_scores",
            f"model = models.ColBERT({path!r})", f"queries = model.encode({EXAMPLE_TEXTS[:1]!r}, is_query=True)",
            f"documents = model.encode({EXAMPLE_TEXTS!r}, is_query=False)",
            "scores = [[float(colbert_scores(q[None], d[None])) for d in documents] for q in queries]  # MaxSim",
            "```"]


def _source_names(card: Mapping[str, Any]) -> list[str]:
    names: list[str] = []
    for split in (card.get("data") or {}).values():
        for name in (split or {}).get("sources") or {}:
            if name not in names:
                names.append(name)
    return names


def _data_rows(split: str, report: Mapping[str, Any]) -> list[list[str]]:
    if "sources" in report:
        return [row for name, sub in report["sources"].items() for row in _data_rows(split, {**sub, "source": name})]
    files = report.get("files") or []
    where = f"`{files[0]}`" if len(files) == 1 else f"{len(files)} files"
    skipped = report.get("skipped") or {}
    skipped_text = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "0"
    if report.get("backend"):  # streamed
        planned = report.get("planned_samples")
        kept = f"streamed ({planned} samples per epoch)" if planned is not None else "streamed (size unknown)"
        rows_read = str(report.get("total", "")) if report.get("total") else "-"
    else:
        kept, rows_read = str(report.get("kept", "-")), str(report.get("total", "-"))
    evaluated = report.get("evaluated")
    return [[split, report.get("source") or "-", where, rows_read, kept, skipped_text,
             "-" if evaluated is None else str(evaluated)]]


def _data_section(data: Mapping[str, Any] | None) -> str:
    if not data:
        return ""
    rows = [row for split in SPLITS if data.get(split) for row in _data_rows(split, data[split])]
    if not rows:
        return ""
    table = _table(["split", "source", "files", "rows read", "rows kept", "rows skipped", "rows evaluated"], rows)
    return ("## Data\n\nRows read, kept for training or evaluation, and skipped (with the reason) as vembed counted "
            "them when it read each file.\n\n" + table)


def _launch_section(launch: Mapping[str, Any] | None) -> str:
    if not launch:
        return ""
    cache = launch.get("gradient_cache")
    rows = [
        ["strategy", launch.get("strategy")],
        ["world size (processes)", launch.get("world_size")],
        ["device", launch.get("device")],
        ["precision", launch.get("precision")],
        ["per-device batch", launch.get("per_device_batch")],
        ["gradient accumulation steps", launch.get("gradient_accumulation_steps")],
        ["contrastive batch (negatives gathered across processes)", launch.get("contrastive_batch")],
        ["effective batch per optimizer step", launch.get("effective_batch")],
        ["GradCache", None if cache is None else (  # the reason reads "on (...)" / "off (...)" / "off"
            f"{cache.get('reason')}; chunks of {cache.get('chunk_size')} samples per forward" if cache.get("enabled")
            else cache.get("reason"))],
        ["LoRA", {True: "yes", False: "no"}.get(launch.get("lora"))],
        ["parameters", None if launch.get("total_parameters") is None else
         f"{launch['trainable_parameters']:,} trainable of {launch['total_parameters']:,}"],
    ]
    return "## Launch\n\n" + _table(["", ""], [[label, str(value)] for label, value in rows if value is not None])


def _training_section(training: Mapping[str, Any] | None, recipe: Mapping[str, Any] | None) -> str:
    if not training or training.get("steps") is None:
        return ""
    recipe = recipe or {}
    planned = (f"max_steps {training['max_steps']}" if training.get("max_steps") is not None
               else f"{training.get('epochs')} epoch(s)")
    loss = training.get("loss") or {}
    rows = [
        ["optimizer steps", training.get("steps")],
        ["epochs completed", training.get("epochs_completed")],
        ["planned length", planned + (f" in {training['stages']} curriculum stages" if training.get("stages") else "")],
        ["samples seen", training.get("samples_seen")],
        ["final training loss", None if training.get("final_loss") is None else f"{training['final_loss']:.4f}"],
        ["learning rate", None if recipe.get("learning_rate") is None else
         f"{recipe['learning_rate']:g} ({recipe.get('scheduler_type')}, warmup ratio {recipe.get('warmup_ratio')})"],
        ["loss", ", ".join(f"{k}={v}" for k, v in _flat(loss).items()) if isinstance(loss, Mapping) else loss],
    ]
    shown = [[label, str(value)] for label, value in rows if value not in (None, "")]
    return "## Training\n\n" + _table(["", ""], shown)


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif value is not None:
            flat[f"{prefix}{key}"] = value
    return flat


_DIM = re.compile(r"(^|/)dim(\d+)(/|$)")


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def metric_groups(names: Sequence[str], sources: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """The evaluation table's sections: metrics over the whole split (for named sources: their mean), then those at
    each Matryoshka dimension, then each named source's own. Any metric name is shown; none is dropped."""
    groups: dict[str, list[str]] = {}
    for name in names:
        first = name.split("/", 1)[0]
        if first in sources:
            group = f"source `{first}`"
        elif _DIM.search(name):
            group = "Matryoshka dimensions"
        else:
            group = ""
        groups.setdefault(group, []).append(name)

    def order(name: str) -> tuple:  # largest Matryoshka dimension first
        dim = _DIM.search(name)
        return (-int(dim.group(2)) if dim else 0, _natural(name))

    ranked = sorted(groups, key=lambda g: (g != "", g != "Matryoshka dimensions", g))
    return [(group, sorted(groups[group], key=order)) for group in ranked]


def _number(value: Any, name: str = "") -> str:
    """Metrics to 4 decimals; counts (`num_queries`) as whole numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    if isinstance(value, int) or (name.rsplit("/", 1)[-1].startswith("num_") and float(value).is_integer()):
        return str(int(value))
    return f"{value:.4f}"


def _evaluation_section(evaluation: Mapping[str, Any] | None, best: Mapping[str, Any] | None,
                        sources: Sequence[str]) -> str:
    if not evaluation:
        return ("## Evaluation\n\nNo evaluation was recorded (the recipe set no `data.validation` or `data.test`).")
    columns = [(key, title) for key, title in EVAL_COLUMNS if evaluation.get(key)]
    from vembed.reranking.metric_names import is_rerank_metrics

    if all(is_rerank_metrics(evaluation[key]) for key, _ in columns):
        return _rerank_evaluation_section(evaluation, best, columns)
    names = list(dict.fromkeys(name for key, _ in columns for name in evaluation[key]))
    parts = ["## Evaluation",
             "The run's `metrics.json` (`q2d`: queries → documents, `d2q`: documents → queries; `accuracy@k`: the "
             "share of queries with a relevant document in the top k; `corpus/recall@k`: trec_eval's recall, the "
             "share of a query's relevant documents in the top k; `dimN`: the embedding cut to its first N "
             "dimensions (Matryoshka); with named sources the unprefixed rows are the mean over sources). "
             "\"before training\" is the untrained model on the validation split."]
    for group, group_names in metric_groups(names, sources):
        rows = [[name] + [_number(evaluation[key].get(name), name) for key, _ in columns] for name in group_names]
        if group:
            parts.append(f"### {group}")
        parts.append(_table(["metric", *(title for _, title in columns)], rows))
    parts += _best_line(best)
    return "\n\n".join(parts)


def _best_line(best: Mapping[str, Any] | None) -> list[str]:
    if not best or best.get("value") is None:
        return []
    return [f"Best validation `{best.get('metric')}` during training: {_number(best['value'])}"
            + (f" ({best['checkpoint']})" if best.get("checkpoint") else "") + "."]


def _rerank_evaluation_section(evaluation: Mapping[str, Any], best: Mapping[str, Any] | None,
                               columns: Sequence[tuple[str, str]]) -> str:
    """A reranker's numbers as what it adds: per evaluated split, the first stage's candidates in their order, the
    same candidates reranked by the model, and the change."""
    from vembed.reranking.metric_names import before_after

    parts = ["## Evaluation",
             "The run's `metrics.json`: each judged query's first-stage candidates (the top 100 of "
             "`data.first_stage_run`) as the first stage ranked them, and reranked by this model, with trec_eval's "
             "definitions (`vembed eval RERANKER CORPUS --first-stage ...` computes the same table). \"before "
             "training\" is the reranker as it started."]
    for key, title in columns:
        metrics = evaluation[key]
        rows = [[name, _number(first), _number(reranked), f"{reranked - first:+.4f}"]
                for name, first, reranked in before_after(metrics)]
        queries = metrics.get("reranked/num_queries")
        parts += [f"### {title}" + (f" ({int(queries)} judged queries)" if queries is not None else ""),
                  _table(["metric", "first stage", "reranked", "change"], rows)]
    parts += _best_line(best)
    return "\n\n".join(parts)


def _plots_section(plots: Sequence[str] | None) -> str:
    if not plots:
        return ""
    lines = ["## Plots", ""]
    for name in plots:
        caption = PLOT_CAPTIONS.get(name, Path(name).stem.replace("_", " "))
        lines += [f"![{caption}]({name})", ""]
    return "\n".join(lines).rstrip()


def _transformers_example(model: Mapping[str, Any], path: str) -> str | None:
    """The adapter's own plain-transformers snippet (None when its embedding needs vembed)."""
    adapter = _adapter_class(model.get("model_type"))
    if adapter is None:
        return None
    return adapter.transformers_example(path, model.get("settings") or {}, EXAMPLE_TEXTS)


def _load_section(model: Mapping[str, Any], flavour: Flavour, path: str, source_path: str | None) -> str:
    model_type = model.get("model_type")
    adapter = _adapter_class(model_type)
    lines = ["## How to use it", ""]
    images = "image" in _modalities(model_type)
    if flavour == "sentence-transformers":
        lines += _sentence_transformers_lines(path, images)
        if source_path:
            lines += ["", f"With vembed, load the folder it was exported from: `vembed.load({source_path!r})`."]
        lines += ["", *_mteb_lines(path, images)]
        return "\n".join(lines)
    reranker = _reranker_class(model_type)
    if reranker is not None:
        return "\n".join(lines + reranker.card_usage(path))
    if adapter is None:  # a generator (blip3o_dit), not an embedding model
        lines += ["```python", "from vembed.generation import load_generator",
                  f"generator = load_generator({path!r})", "```"]
        return "\n".join(lines)
    shape = f"({len(EXAMPLE_TEXTS)}, {model.get('embedding_dim')})"
    if _multi_vector(model):  # token vectors: encoded per role, scored by MaxSim
        documents = "images=['page.png']" if images else repr(EXAMPLE_TEXTS)  # ColQwen: page screenshots
        usage = [f"queries = model.encode_token_vectors({EXAMPLE_TEXTS[:1]!r}, role='query')  # (1, tokens, "
                 f"{model.get('embedding_dim')})",
                 f"documents = model.encode_token_vectors({documents}, role='document')",
                 "scores = model.score(queries, documents)  # late interaction (MaxSim)"]
    elif _static_queries(model):
        usage = [f"queries = model.encode(texts={EXAMPLE_TEXTS[:1]!r}, role='query')  # static weights: no forward "
                 "pass", f"documents = model.encode(texts={EXAMPLE_TEXTS!r}, role='document')  # {shape}, mostly zeros",
                 "scores = queries @ documents.T  # scored by dot product"]
    elif _sparse(model):
        usage = [f"embeddings = model.encode(texts={EXAMPLE_TEXTS!r})  # {shape}, mostly zeros",
                 "scores = embeddings[:1] @ embeddings.T  # scored by dot product"]
    else:
        usage = [f"embeddings = model.encode(texts={EXAMPLE_TEXTS!r})  # {shape}"
                 if "text" in adapter.modalities else "embeddings = model.encode(images=['photo.jpg'])"]
    loss_state = model.get("loss_state") or {}
    if loss_state.get("class_scores"):
        usage += ["scores = model.class_scores(images=['photo.jpg'])  # (1, classes): cosine to each class's "
                  "nearest trained centre", "labels = model.classify(images=['photo.jpg'])  # the best class's name"]
    lines += ["With vembed (`pip install vembed`):", "", "```python", "import vembed",
              f"model = vembed.load({path!r})", *usage]
    if images and "text" in adapter.modalities and not _multi_vector(model):
        lines.append("# images: model.encode(images=['photo.jpg']) (paths or PIL images)")
    lines.append("```")
    if loss_state:
        lines += ["", f"The trained state of the loss ({loss_state.get('loss')}: its class centres, learnable "
                  f"temperature or bias) is saved beside the weights in `{loss_state.get('file')}`; `vembed.load` "
                  "restores it. Plain transformers and a sentence-transformers export leave it out."]
    example = _transformers_example(model, path)
    lines += ["", "With plain transformers:", ""]
    if example:
        lines += ["```python", example.rstrip(), "```"]
    else:
        lines.append(f"Not without vembed: a `{model_type}` model's embedding is computed by vembed's adapter "
                     "(its pooling, prompt format or projections are not a transformers model's own output), so "
                     "load it with vembed as above.")
    lines += [""]
    if _exportable(model):
        export = f"{path.rstrip('/')}-st"
        lines += ["With sentence-transformers: export it first (the export embeds as vembed does, checked on "
                  "probe inputs), then load the export:", "", "```bash", f"vembed export {path} --out {export}",
                  "```", "", *_sentence_transformers_lines(export, images), "", *_mteb_lines(export, images)]
    elif _static_queries(model):
        lines += ["With sentence-transformers (>= 6), which reads the folder as it is (a Router: static query "
                  "weights, MLM transformer and SPLADE pooling for documents):", "", "```python",
                  "from sentence_transformers import SparseEncoder", f"model = SparseEncoder({path!r})",
                  f"queries = model.encode_query({EXAMPLE_TEXTS[:1]!r})",
                  f"documents = model.encode_document({EXAMPLE_TEXTS!r})",
                  "scores = model.similarity(queries, documents)  # dot product", "```"]
    elif _sparse(model):
        lines += ["With sentence-transformers (>= 5), which reads the folder as it is (MLM transformer, SPLADE "
                  "pooling):", "", "```python", "from sentence_transformers import SparseEncoder",
                  f"model = SparseEncoder({path!r})", f"embeddings = model.encode({EXAMPLE_TEXTS!r})",
                  "scores = model.similarity(embeddings[:1], embeddings)  # dot product", "```"]
    elif _multi_vector(model) and _token_vectors_of(model).pylate_folder:
        lines += [*_pylate_lines(path), "", "sentence-transformers >= 6 reads the same folder: "
                  f"`MultiVectorEncoder({path!r})`."]
    elif _multi_vector(model):
        lines.append(f"sentence-transformers: a `{model_type}` model's token vectors have no sentence-transformers "
                     "equivalent; evaluate it on a corpus folder with `vembed eval`.")
    else:
        lines.append(f"sentence-transformers: a `{model_type}` model has no sentence-transformers equivalent "
                     "(`vembed export` refuses it); evaluate it with `vembed eval`.")
    return "\n".join(lines)


def _sentence_transformers_lines(path: str, images: bool) -> list[str]:
    lines = ["```python", "from sentence_transformers import SentenceTransformer",
             f"model = SentenceTransformer({path!r})",
             f"embeddings = model.encode({EXAMPLE_TEXTS!r})"]
    if images:
        lines.append("# images: model.encode([PIL.Image.open('photo.jpg')])")
    return lines + ["```"]


def _mteb_lines(path: str, images: bool) -> list[str]:
    tasks = '["Flickr30kI2TRetrieval"]' if images else '["NFCorpus", "SciFact"]'
    return [
        "Evaluate it on [MTEB](https://github.com/embeddings-benchmark/mteb) (`pip install 'mteb>=2'`; the tasks "
        "download their data from the Hugging Face Hub):", "", "```python", "import mteb",
        "from sentence_transformers import SentenceTransformer", f"model = SentenceTransformer({path!r})",
        f"tasks = mteb.get_tasks(tasks={tasks})" + ("  # image-text tasks (MIEB) for an image model" if images else ""),
        "results = mteb.evaluate(model, tasks=tasks)", "print(results.to_dataframe())", "```",
    ]


def _recipe_section(recipe: Mapping[str, Any] | None) -> str:
    if not recipe:
        return ""
    text = yaml.safe_dump(dict(recipe), sort_keys=False).rstrip()
    return ("## Recipe\n\nThe full recipe as the run resolved it (defaults and overrides applied); "
            "`vembed train recipe.yaml` with it trains this model again.\n\n<details>\n<summary>recipe.yaml"
            "</summary>\n\n```yaml\n" + text + "\n```\n\n</details>")


def recipe_from_card(text: str) -> dict[str, Any]:
    """The resolved recipe written into a card (README.md text), as a dict."""
    match = re.search(r"<summary>recipe\.yaml</summary>\s*```yaml\n(.*?)\n```", text, re.S)
    if match is None:
        raise ValueError("the card holds no recipe")
    return yaml.safe_load(match.group(1))


def code_blocks(text: str, language: str = "python") -> list[str]:
    """The fenced code blocks of one language in a card."""
    return re.findall(rf"```{language}\n(.*?)\n```", text, re.S)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
