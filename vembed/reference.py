"""The recipe reference (docs/reference/recipe.md), generated from the schema and the registered components' Settings.

Every key gets its type, its default as YAML shows it, its owner and its meaning: the field's `description=`, else its
comment in the source (the comment on its line, then the comment block above it), else a line of `MEANINGS`.
Regenerate with `python -m vembed.reference > docs/reference/recipe.md` (or `make reference`);
tests/test_recipe_reference.py fails while the committed file differs from the output.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from vembed.components import CATALOG
from vembed.recipe import SELECTORS, Recipe

COMMAND = "python -m vembed.reference > docs/reference/recipe.md"
DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "recipe.md"

# Meanings of fields whose source has neither a description nor a comment, by "Class.field" of the class declaring it.
MEANINGS: dict[str, str] = {
    "Recipe.output_dir": "where checkpoints, metrics, the final model and the resolved recipe are written",
    "Recipe.learning_rate": "peak learning rate of AdamW",
    "Recipe.weight_decay": "AdamW's weight decay",
    "Recipe.epochs": "passes over data.train (max_steps overrides it)",
    "Recipe.scheduler_type": "learning-rate schedule after warmup",
    "Recipe.gradient_checkpointing": "recompute activations in the backward pass to save memory",
    "Recipe.seed": "seed of initialisation, shuffling, augmentation and sampling",
    "Recipe.use_lora": "train PEFT LoRA adapters instead of all weights",
    "Recipe.lora_alpha": "LoRA scaling numerator (updates are scaled by lora_alpha / lora_r)",
    "Recipe.lora_dropout": "dropout on the LoRA branch",
    "Recipe.logging_steps": "optimizer steps between log lines",
    "Recipe.run_name": "the run's name in the trackers (report_to; unset: vembed) and its model card (unset: the "
                       "output_dir's name)",
    "DataConfig.train": "the training pairs: a file, glob, directory, a list of them, or named sources",
    "DataConfig.test": "the pairs evaluated once at the end: as data.train",
    "DataConfig.num_workers": "DataLoader worker processes (0: read in the training process)",
    "SourceConfig.format": "how this source's files are read (unset: as data.format)",
    "SourceConfig.columns": "which column holds which part of a record (unset: as data.columns)",
    "SourceConfig.image_root": "relative image paths of this source resolve against it (unset: as data.image_root)",
    "SourceConfig.num_hard_negatives": "hard negatives per record (unset: as data.num_hard_negatives)",
    "QrelsSplits.train": "the qrels/<name>.tsv that data.train reads",
    "QrelsSplits.validation": "the qrels/<name>.tsv that data.validation reads",
    "QrelsSplits.test": "the qrels/<name>.tsv that data.test reads",
    "FirstStageRuns.validation": "the first stage's TREC run on data.validation's corpus folder",
    "FirstStageRuns.test": "the first stage's TREC run on data.test's corpus folder",
    "AugmentationConfig.crop_ratio": "aspect-ratio range [low, high] of the random resized crop",
    "AugmentationConfig.cutmix_alpha": "cutmix's Beta(alpha, alpha) mixing weight (0: off)",
    "ProfileConfig.enabled": "profile a window of training batches",
    "VisionSettings.label_names": "the classes' names, in label-id order (unset: filled from the data)",
    "EmbeddingLossSettings.learnable_temperature": "learn the temperature during training (as log(1 / temperature))",
    "TripletSettings.triplet_distance": "distance between embeddings: euclidean, cosine (1 - cos) or manhattan",
    "BatchHardTripletSettings.triplet_margin": "the hardest negative must be this much further than the hardest "
                                              "positive",
    "BatchHardTripletSettings.batch_hard_distance": "distance between embeddings (cosine: 1 - cos)",
    "GISTEmbedSettings.gist_margin_strategy": "how gist_margin masks candidates: absolute or relative (see "
                                              "gist_margin)",
    "ListDistillSettings.teacher_temperature": "the teacher's scores are divided by it (unset: temperature)",
    "FlowSection.logit_normal_std": "logit_normal: the std of the normal that t = sigmoid(N(mean, std)) draws",
    "FlowSection.beta_b": "beta: b of t ~ Beta(a, b)",
}


@dataclass(frozen=True)
class Row:
    key: str  # dotted, as written in YAML (`data.columns.query`, `stages[].epochs`, `data.train.<name>.files`)
    type: str
    default: str
    owner: str
    meaning: str


@dataclass(frozen=True)
class Table:
    title: str
    intro: str
    rows: tuple[Row, ...]


# --- one field ------------------------------------------------------------------------------------------------------


def section_models(annotation: Any, container: str = "") -> list[tuple[type[BaseModel], str]]:
    """The pydantic models a field holds, each with how it is held: "" (itself), "list" or "dict"."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, container)]
    origin = typing.get_origin(annotation)
    inner = container or ("list" if origin in (list, tuple) else "dict" if origin is dict else "")
    return [found for arg in typing.get_args(annotation) for found in section_models(arg, inner)]


def type_name(annotation: Any, homes: dict[type, str]) -> str:
    """A readable type: `int`, `float | None`, `list[str]`, `"a" | "b"`; a section as its keys (`data.columns.*`)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"{homes[annotation]}.*"
    if origin is typing.Literal:
        return " | ".join(f'"{arg}"' if isinstance(arg, str) else repr(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in args if arg is not type(None)] + [arg for arg in args if arg is type(None)]
        return " | ".join(type_name(arg, homes) for arg in members)
    if origin is not None:  # list, dict, tuple, ...
        return f"{origin.__name__}[{', '.join(type_name(arg, homes) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((annotated_types.Gt, "> {}", "gt"), (annotated_types.Ge, ">= {}", "ge"),
           (annotated_types.Lt, "< {}", "lt"), (annotated_types.Le, "<= {}", "le"))


def bounds(field: FieldInfo) -> str:
    """The field's numeric range (`> 0`, `>= 0, < 1`), as pydantic enforces it; empty when unbounded."""
    found = []
    for constraint in field.metadata:
        for kind, text, attribute in _BOUNDS:
            if isinstance(constraint, kind):
                found.append(text.format(getattr(constraint, attribute)))
    return ", ".join(found)


def yaml_default(field: FieldInfo) -> str:
    """The default as YAML writes it (`null`, `true`, `[]`, `5.0e-05`); a section's is `{}` (each key's default);
    `required` where there is none."""
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return yaml_value(value)


def yaml_value(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = {}
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").strip()


# --- meanings from the source ----------------------------------------------------------------------------------------


@functools.cache
def source_comments(cls: type) -> dict[str, str]:
    """Each field of `cls`'s own body -> its comment: the one on its lines, else the block right above it (a
    `# --- section ---` rule or a blank line ends the block). A block above a field that has its own comment is
    about a group of fields, not this one."""
    source = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
    lines = source.splitlines()
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    alone = {number for number in comments if lines[number - 1].lstrip().startswith("#")}
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        on_lines = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above = []
        number = node.lineno - 1
        while number in alone and not comments[number].startswith("---"):
            above.insert(0, comments[number])
            number -= 1
        found[node.target.id] = " ".join(on_lines or above)
    return found


def declaring_class(model: type[BaseModel], name: str) -> type:
    """The class in `model`'s MRO whose body declares field `name` (its comment is there)."""
    return next(cls for cls in model.__mro__ if name in vars(cls).get("__annotations__", {}))


def meaning(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    if field.description:
        return field.description
    owner = declaring_class(model, name)
    sections = section_models(field.annotation)
    return (source_comments(owner).get(name) or MEANINGS.get(f"{owner.__name__}.{name}")
            or (docstring_line(sections[0][0]) if sections else ""))


# --- tables ---------------------------------------------------------------------------------------------------------


def keys_of(model: type[BaseModel]) -> Iterator[tuple[str, str, FieldInfo]]:
    """(field name, key as written in YAML, field) of each field of `model`, in declaration order."""
    for name, field in model.model_fields.items():
        yield name, field.alias or name, field


def child_prefix(key: str, container: str) -> str:
    return {"list": f"{key}[]", "dict": f"{key}.<name>"}.get(container, key)


def rows_of(model: type[BaseModel], prefix: str, owner: str, homes: dict[type, str],
            skip: frozenset[str] = frozenset()) -> tuple[list[Row], list[type[BaseModel]]]:
    """The rows of `model`'s own fields under `prefix`, and the section models first met here (given a home in
    `homes`, where their keys are listed)."""
    rows, new = [], []
    for name, key, field in keys_of(model):
        if name in skip:
            continue
        dotted = f"{prefix}.{key}" if prefix else key
        for section, container in section_models(field.annotation):
            if section not in homes:
                homes[section] = child_prefix(dotted, container)
                new.append(section)
        kind = type_name(field.annotation, homes)
        limits = bounds(field)
        rows.append(Row(dotted, f"{kind}, {limits}" if limits else kind, yaml_default(field), owner,
                        meaning(model, name, field)))
    return rows, new


def docstring_line(cls: type) -> str:
    """The first paragraph of `cls`'s docstring as one line."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())


def recipe_tables() -> list[Table]:
    """The recipe's own keys: the top level, then one table per section (data.*, data.columns.*, stages[].*, ...)."""
    homes: dict[type, str] = {Recipe: ""}
    tables = []
    pending: list[type[BaseModel]] = [Recipe]
    while pending:
        model = pending.pop(0)
        prefix = homes[model]
        owner = prefix.split(".")[0].split("[")[0] or "recipe"
        rows, new = rows_of(model, prefix, owner, homes, skip=frozenset(SELECTORS.values()))
        if model is Recipe:
            rows = [selector_row(row) for row in rows]
        tables.append(Table(f"`{prefix}.*`" if prefix else "Top-level keys", docstring_line(model), tuple(rows)))
        pending = new + pending  # depth first: a section's subsections follow it
    return tables


def selector_row(row: Row) -> Row:
    """model_type / loss_type are typed `str` in the schema; their choices are the registered names."""
    if row.key not in SELECTORS:
        return row
    choices = " | ".join(f'"{name}"' for name in CATALOG.names(row.key))
    return Row(row.key, choices, row.default, row.owner, row.meaning)


def component_tables(selector: str) -> list[Table]:
    """One table per registered component of `selector` (sorted by name): every key its Settings declares, its
    sections' keys flattened in (`dit.size`)."""
    tables = []
    for name in CATALOG.names(selector):
        component = CATALOG.component(selector, name)
        settings = component.Settings
        rows = component_rows(settings, f"{selector}: {name}")
        where = f"{component.__module__.replace('.', '/')}.py"
        intro = f"Declared by `{component.__name__}.Settings` ({settings.__name__}) in {where}."
        if settings.recipe_defaults:
            defaults = sorted(settings.recipe_defaults.items())
            changed = ", ".join(f"`{key}: {yaml_value(value)}`" for key, value in defaults)
            intro += f" Changes recipe defaults: {changed} (unless the recipe sets them)."
        tables.append(Table(f"`{selector}: {name}`", intro, tuple(rows)))
    return tables


def component_rows(settings: type[BaseModel], owner: str) -> list[Row]:
    homes: dict[type, str] = {}
    rows, pending = rows_of(settings, "", owner, homes)
    while pending:
        section = pending.pop(0)
        more_rows, more = rows_of(section, homes[section], owner, homes)
        rows += more_rows
        pending = more + pending
    return rows


# --- markdown -------------------------------------------------------------------------------------------------------


def cell(text: str, code: bool = False) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text}`" if code and text else text


def table_markdown(table: Table) -> str:
    lines = [f"### {table.title}", ""]
    if table.intro:
        lines += [table.intro, ""]
    if not table.rows:
        return "\n".join(lines + ["No keys of its own.", ""])
    lines += ["| key | type | default | owner | meaning |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {cell(row.key, True)} | {cell(row.type, True)} | {cell(row.default, True)} | {cell(row.owner)} | "
              f"{cell(row.meaning)} |" for row in table.rows]
    return "\n".join(lines + [""])


def all_tables() -> dict[str, list[Table]]:
    return {"The recipe's own keys": recipe_tables(),
            "Adapter keys (`model_type`)": component_tables("model_type"),
            "Loss keys (`loss_type`)": component_tables("loss_type")}


def render() -> str:
    """The whole reference, deterministic (registries sorted, no dates)."""
    parts = [f"<!-- Generated by vembed/reference.py; do not edit. Regenerate: {COMMAND} (or make reference) -->",
             "", "# Recipe reference", "",
             "Every key a recipe may hold. YAML is flat: the adapter's keys (`model_type`) and the loss's keys "
             "(`loss_type`) sit beside the recipe's own, and a key belongs to the recipe or to the component it "
             "names in the owner column. Sections (`data:`, `augmentation:`, ...) nest. Defaults are what a recipe "
             "that leaves the key out gets; `required` keys have none. The schema is vembed/recipe.py; each "
             "component's keys are its `Settings` class.", ""]
    for heading, tables in all_tables().items():
        parts += [f"## {heading}", ""]
        parts += [table_markdown(table) for table in tables]
    return "\n".join(parts).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
