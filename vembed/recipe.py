"""The recipe: one typed schema, the only home of defaults, plus YAML loading, overrides and saving.

A recipe is validated in two stages, both before any model is built:
1. `load_recipe` checks keys, types and ranges (pydantic, `extra="forbid"`), turning the first problem into a
   `RecipeError` naming the key path and the fix.
2. `check_recipe` checks what needs the registries or the file system: the adapter and loss exist, the data files
   exist, `mrl_dims` fit the embedding size the model's config declares.
"""

from __future__ import annotations

import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vembed.errors import RecipeError, did_you_mean

TRACKERS = ("tensorboard", "wandb", "trackio")


# Defaults that differ per adapter, applied when a recipe leaves the key out. qwen_vl: the released
# Qwen3-VL-Embedding LoRA is r=32, alpha=32.
ADAPTER_DEFAULTS: dict[str, dict[str, Any]] = {"qwen_vl": {"lora_r": 32, "lora_alpha": 32}}


class _Strict(BaseModel):
    # Unknown keys are errors (with a hint), never silently ignored; assignments are validated too.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: Any) -> Any:
        # pydantic reads true as 1 for a number; `batch_size: true` is a mistake, not a batch of one.
        if isinstance(value, bool) and _numbers_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expects a number, not {str(value).lower()}")
        return value


def _numbers_only(annotation: Any) -> bool:
    """The annotation admits numbers (int/float, maybe None) and nothing else."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        leaves = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    else:
        leaves = [annotation]
    return bool(leaves) and all(leaf in (int, float) for leaf in leaves)


class ColumnMap(_Strict):
    """Which column of a data file holds which part of a record. Columns absent from a file are simply unused."""

    query: str = "query"  # query text
    # Image columns hold a path (relative to data.image_root), or a list of paths: several images per sample
    # (qwen_vl; single-image models refuse a side with more than one).
    query_image: str = "query_image"  # query image path(s)
    positive: str = "positive"  # positive (document) text
    positive_image: str = "positive_image"  # positive image path(s)
    negatives: str = "negatives"  # hard-negative texts: a list, or one string
    negative_images: str = "negative_images"  # hard-negative images: a list (one entry per negative), or one string
    label: str = "label"  # optional group id: items sharing it count as relevant in evaluation


class DataConfig(_Strict):
    """Where the pairs come from. A source is a file, a glob, a directory, or a list of them."""

    train: str | list[str] | None = None
    validation: str | list[str] | None = None
    test: str | list[str] | None = None
    # auto: from the file extension (.jsonl/.json, .csv, .parquet); hf: any local `datasets.load_dataset` path;
    # shards: a directory written by `vembed extract` (paired teacher embeddings; what blip3o_dit trains on).
    format: Literal["auto", "jsonl", "json", "csv", "parquet", "hf", "shards"] = "auto"
    columns: ColumnMap = Field(default_factory=ColumnMap)
    # Relative image paths are resolved against this directory; unset: the directory of the data file.
    image_root: str | None = None
    # Hard negatives per record; unset: the smallest number any training record has (0 when none have any).
    num_hard_negatives: int | None = Field(default=None, ge=0)
    # Rows that are empty or point at missing/corrupt images are skipped and counted; above this share, stop.
    max_bad_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    num_workers: int = Field(default=0, ge=0)
    # Read data.train as a stream (vembed/data/streaming.py): WebDataset tar shards, or JSONL/CSV/Parquet files, for
    # corpora larger than a disk or memory. Unset: on exactly when data.train names .tar shards.
    streaming: bool | None = None
    # Streaming: samples each reader (rank x worker) holds to shuffle its shards' samples; more mixes better, costs
    # memory (a few hundred KB per image sample) and start-up time (the buffer fills before the first batch).
    shuffle_buffer: int = Field(default=1000, gt=0)
    # Evaluate on at most this many records per split (unset: all).
    eval_max_samples: int | None = Field(default=None, gt=0)


class DiTSettings(_Strict):
    """`dit:` the BLIP3-o diffusion transformer (model_type: blip3o_dit). Token shapes come from the shards; any
    stated here must match them."""

    size: Literal["tiny", "small", "base", "large"] | None = "base"  # hidden/layers/heads preset; explicit keys win
    hidden_size: int | None = Field(default=None, gt=0)  # unset: from size (tiny 384, small 512, base 768, large 1024)
    num_layers: int | None = Field(default=None, gt=0)  # DiT blocks (unset: from size: 6, 8, 12, 20)
    num_heads: int | None = Field(default=None, gt=0)  # attention heads (unset: from size)
    num_kv_heads: int | None = Field(default=None, gt=0)  # key/value heads of grouped-query attention (unset: size)
    mlp_ratio: float = Field(default=4.0, gt=0)  # SwiGLU width = hidden_size * mlp_ratio * 2/3
    eva_adapter_layers: int = Field(default=6, gt=0)  # blocks taking the EVA dim down to hidden_size
    layer_scale_init: float = Field(default=0.1, gt=0)  # initial per-channel scale of every residual branch
    rope_theta: float = Field(default=10000.0, gt=0)  # rotary base of the 2-D token-grid positions
    eva_dim: int | None = Field(default=None, gt=0)  # checked against the shards (unset: taken from them)
    clip_dim: int | None = Field(default=None, gt=0)  # checked against the shards (unset: taken from them)
    num_tokens: int | None = Field(default=None, gt=0)  # CLIP tokens per image; checked against the shards


class FlowSettings(_Strict):
    """`flow:` rectified flow matching (loss_type: flow_matching): t=0 noise, t=1 data, v = data - noise."""

    time_sampling: Literal["uniform", "logit_normal", "beta"] = "uniform"  # training time distribution on [0, 1]
    logit_normal_mean: float = 0.0  # logit_normal: t = sigmoid(N(mean, std))
    logit_normal_std: float = Field(default=1.0, gt=0)
    beta_a: float = Field(default=1.0, gt=0)  # beta: t ~ Beta(a, b)
    beta_b: float = Field(default=1.0, gt=0)
    cosine_weight: float = Field(default=0.0, ge=0)  # weight of (1 - cos) between the clean estimate and the data
    data_scale: float = Field(default=1.0, gt=0)  # fixed multiplier of the CLIP tokens (no data statistics)
    sampler: Literal["euler", "heun"] = "heun"  # ODE solver used by evaluation
    num_steps: int = Field(default=50, gt=0)  # solver steps (heun evaluates the model twice per step)
    eval_seed: int = 0  # seed of the evaluation noise: generation is deterministic given it


class ProfileConfig(_Strict):
    """`profile:` — torch.profiler over a window of training batches: a Chrome trace per rank (open it in
    https://ui.perfetto.dev or chrome://tracing) and a printed step-time breakdown (data wait, forward, backward,
    optimizer, communication). Batches are counted from the start of this launch (micro-batches under accumulation).
    """

    enabled: bool = False
    wait: int = Field(default=1, ge=0)  # batches run before profiling starts (skips first-step allocation noise)
    warmup: int = Field(default=1, ge=0)  # batches profiled but discarded (the profiler's own start-up cost)
    active: int = Field(default=3, gt=0)  # batches recorded in the trace and the breakdown
    output_dir: str | None = None  # traces and breakdowns; unset: <output_dir>/profile


class Recipe(_Strict):
    """Everything a training run needs. Field comments are the reference documentation of each key."""

    # --- model -----------------------------------------------------------------------------------------------------
    model_type: str = "clip"  # adapter name: clip, siglip, text, composed, qwen_vl, blip3o_dit
    model_name: str | None = None  # hub id or local path of pretrained weights
    # `model_config` in YAML: a config dict to build a randomly initialised model instead. (Renamed in Python only
    # because pydantic reserves `model_config`.)
    model_config_dict: dict[str, Any] | None = Field(default=None, alias="model_config")
    tokenizer_name: str | None = None  # tokenizer/processor path when it is not beside model_name
    text_model_name: str | None = None  # composed: text tower (hub id or path) ...
    text_model_config: dict[str, Any] | None = None  # ... or its config for random init
    vision_model_name: str | None = None  # composed: vision tower (hub id or path) ...
    vision_model_config: dict[str, Any] | None = None  # ... or its config for random init
    projection_dim: int | None = Field(default=None, gt=0)  # composed: shared embedding size (unset: text hidden size)
    pooling: Literal["cls", "mean", "last"] = "mean"  # text and composed adapters
    normalize: bool = True  # L2-normalise embeddings
    max_length: int | None = Field(default=None, gt=0)  # tokens per text (unset: the model's own limit)
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # e.g. sdpa, eager, flash_attention_2 (unset: transformers' choice)

    # --- qwen_vl: instruction-aware VLM embedders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-Embedding) --------------
    # The system-turn instruction of query sides; unset: document_instruction.
    query_instruction: str | None = None
    # The system-turn instruction of documents (positives, hard negatives) and of sides of unknown role.
    document_instruction: str = "Represent the user's input."
    min_pixels: int | None = Field(default=None, gt=0)  # images are resized to hold at least this many pixels ...
    max_pixels: int | None = Field(default=None, gt=0)  # ... and at most this many (unset: the checkpoint's values)
    train_vision_tower: bool = False  # false: the vision tower is frozen (with or without LoRA)
    # With use_lora, what the saved model holds: "merged" (LoRA folded in; a plain transformers folder) or "adapter"
    # (only the LoRA weights, PEFT file names; loading reads model_name again). Read by qwen_vl only so far.
    lora_save: Literal["merged", "adapter"] = "merged"
    # How each sequence ends (the embedding is the state at its last token): "endoftext", the technical report's
    # "<|im_end|>, newline, <|endoftext|>"; or "generation_prompt", "<|im_end|>, newline, <|im_start|>assistant,
    # newline", what the released Qwen3-VL-Embedding inference code feeds (to match embeddings it or vLLM makes).
    prompt_ending: Literal["endoftext", "generation_prompt"] = "endoftext"

    # --- data and output -------------------------------------------------------------------------------------------
    data: DataConfig = Field(default_factory=DataConfig)
    output_dir: str = "runs/vembed"
    persistent_dir: str | None = None  # checkpoints are mirrored here (long-term storage) after each save

    # --- optimisation ----------------------------------------------------------------------------------------------
    batch_size: int = Field(default=32, gt=0)  # per device; the contrastive batch is batch_size x world size
    eval_batch_size: int | None = Field(default=None, gt=0)  # unset: batch_size
    learning_rate: float = Field(default=5e-5, gt=0)
    # Linear scaling rule: when true, the optimizer uses learning_rate x number of processes (logged at start), so a
    # recipe tuned on one device keeps its per-sample step size when the contrastive batch grows with world size.
    scale_lr_with_world_size: bool = False
    weight_decay: float = Field(default=0.01, ge=0)
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0)  # optimizer steps; when set, it overrides epochs
    scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)  # unset: no clipping
    # Plain accumulation averages gradients of several batches; it does NOT add negatives to the contrastive batch
    # (use use_gradient_cache for that).
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    gradient_checkpointing: bool = False
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None  # unset: what the accelerate config says
    seed: int = 42

    # --- loss ------------------------------------------------------------------------------------------------------
    loss_type: str = "infonce"  # infonce, siglip (contrastive models); flow_matching (blip3o_dit)
    temperature: float = Field(default=0.05, gt=0)  # infonce: logits / temperature; siglip: initial scale 1/temperature
    learnable_temperature: bool = False
    symmetric_loss: bool = True  # infonce: also score documents -> queries
    siglip_bias_init: float = -10.0  # siglip: initial learnable bias
    # infonce, as in the Qwen3-(VL-)Embedding recipe: drop in-batch negatives scoring above the positive + margin
    # (likely unlabelled positives) ...
    mask_false_negatives: bool = False
    false_negative_margin: float = Field(default=0.1, ge=0.0)  # ... by this margin of cosine similarity
    query_query_loss: bool = False  # infonce: other queries of the batch are negatives of each query too
    document_document_loss: bool = False  # infonce: other positives of the batch are negatives of each positive
    mrl_dims: list[int] | None = None  # Matryoshka: apply the loss at each truncated dimension
    mrl_weights: list[float] | None = None  # per-dimension weights (unset: all 1)

    # --- BLIP3-o DiT and flow matching (model_type: blip3o_dit, loss_type: flow_matching) --------------------------
    dit: DiTSettings = Field(default_factory=DiTSettings)
    flow: FlowSettings = Field(default_factory=FlowSettings)

    # --- LoRA ------------------------------------------------------------------------------------------------------
    use_lora: bool = False
    lora_r: int = Field(default=16, gt=0)
    lora_alpha: int = Field(default=32, gt=0)
    lora_dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    lora_target_modules: list[str] | None = None  # unset: the adapter's default

    # --- strategies ------------------------------------------------------------------------------------------------
    # GradCache: the contrastive batch stays batch_size x world size while activations are those of one chunk.
    # Unset: on when gradient_checkpointing is on and the model has more than 1B parameters (the run says so).
    use_gradient_cache: bool | None = None
    # Samples (per device) encoded per forward chunk under GradCache; smaller saves memory, larger runs faster.
    # Unset: 8, or the per-device batch if that is smaller.
    gradient_cache_chunk_size: int | None = Field(default=None, gt=0)
    # FSDP2 (sharded weights, gradients, optimizer state): run.py / `vembed train` launch accelerate_configs/fsdp.yaml;
    # with `accelerate launch`, pass an FSDP config yourself (the run refuses a launch that is not FSDP).
    use_fsdp: bool = False

    # --- checkpoints, evaluation, logging --------------------------------------------------------------------------
    logging_steps: int = Field(default=10, gt=0)
    save_steps: int | None = Field(default=500, gt=0)  # unset: no intermediate checkpoints
    save_total_limit: int = Field(default=2, gt=0)  # recent checkpoints kept, besides the best one
    eval_steps: int | None = Field(default=None, gt=0)  # unset: evaluate at the end of each epoch
    eval_before_training: bool = True  # record the untrained model's metrics for comparison
    metric_for_best_model: str = "q2d/recall@1"  # validation metric that picks the best checkpoint (higher is better)
    # Every log line also records samples/s, tokens/s, peak memory and MFU (vembed/training/throughput.py).
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(default_factory=list)
    run_name: str | None = None
    # "auto": the newest good checkpoint in output_dir (damaged ones are skipped, naming the bad file; another run's
    # are refused), or a fresh start when there is none; or a checkpoint path. Unset: a new run, refused when
    # output_dir already holds checkpoints or a final model.
    resume_from: str | None = None
    overwrite_output_dir: bool = False  # start again in an output_dir holding a run: its outputs are removed first

    @model_validator(mode="before")
    @classmethod
    def _adapter_defaults(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("model_type"), str):  # a wrong type is the schema's to report
            raw = {**ADAPTER_DEFAULTS.get(raw["model_type"], {}), **raw}  # the recipe's own values win
        return raw


    # --- profiling -------------------------------------------------------------------------------------------------
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        if value is None or value == "none":
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML reads a bare `no` as false: `mixed_precision: no` means "no".
        return "no" if value is False else value

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _single_to_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _cross_checks(self) -> "Recipe":
        if self.mrl_dims is not None:
            if not self.mrl_dims:
                raise _KeyError("mrl_dims", "is empty; list at least one dimension or remove the key")
            if any(d <= 0 for d in self.mrl_dims):
                raise _KeyError("mrl_dims", f"dimensions must be positive, got {self.mrl_dims}")
            if len(set(self.mrl_dims)) != len(self.mrl_dims):
                raise _KeyError("mrl_dims", f"has repeated dimensions: {self.mrl_dims}")
            if self.mrl_dims != sorted(self.mrl_dims, reverse=True):
                raise _KeyError("mrl_dims", f"{self.mrl_dims} is not from largest to smallest; write "
                                            f"{sorted(self.mrl_dims, reverse=True)}")
        if self.mrl_weights is not None:
            if self.mrl_dims is None:
                raise _KeyError("mrl_weights", "is set but mrl_dims is not; set mrl_dims or remove mrl_weights")
            if len(self.mrl_weights) != len(self.mrl_dims):
                raise _KeyError(
                    "mrl_weights",
                    f"has {len(self.mrl_weights)} weights for {len(self.mrl_dims)} mrl_dims; give one per dimension",
                )
        if self.gradient_cache_chunk_size is not None and self.use_gradient_cache is False:
            raise _KeyError("gradient_cache_chunk_size", "is set but use_gradient_cache is false; set it to true")
        return self

    # --- helpers ---------------------------------------------------------------------------------------------------
    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.batch_size

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write the resolved recipe (defaults and overrides applied) as YAML, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        tmp.replace(path)


class _KeyError(ValueError):
    """Raised inside validators so the error names the key it is about, not the model."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}")


# --- loading -------------------------------------------------------------------------------------------------------


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError("--config_override", f"{text!r} is not key=value (e.g. learning_rate=1e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError("--config_override", f"{text!r} has no key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError("--config_override", f"{text!r}: the value is not valid YAML ({problem}); quote text "
                                               "with spaces or brackets") from None
    return key.split("."), value


def _coerce_scientific(value: Any) -> Any:
    # YAML 1.1 reads `1e-5` (no dot) as a string; accept it as the number every user means.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in "eE") and value.lower() not in ("none", "null") else value
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = _parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(".".join(path), f"cannot set a sub-key: {part!r} is not a mapping")
            node = child
        node[path[-1]] = value
    return raw


def _fields_at(loc: tuple[str | int, ...]) -> list[str]:
    """Names of the keys valid at the level of `loc` (for 'did you mean')."""
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == str(part)), None)
        annotation = getattr(field, "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            return []
    return [field.alias or name for name, field in model.model_fields.items()]


# pydantic names the member of a union (`str`, `list[str]`) or the validator in an error's location; no key is.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z_-]+\[.*\])$")


def _key_path(error: dict[str, Any]) -> tuple[str | int, ...]:
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":  # the last part is the user's unknown key, whatever it is called
        return tuple(p for p in loc[:-1] if not (isinstance(p, str) and _TYPE_TAG.match(p))) + loc[-1:]
    return tuple(p for p in loc if not (isinstance(p, str) and _TYPE_TAG.match(p)))


def _error_to_recipe_error(err: ValidationError, source: str | None) -> RecipeError:
    first = err.errors()[0]
    loc = _key_path(first)
    key = ".".join(str(p) for p in loc) or "recipe"
    more = len({_key_path(e) for e in err.errors()}) - 1  # a union reports each member: one key, one problem
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    ctx = first.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, _KeyError):
        return RecipeError(inner.key, inner.message + suffix, source)
    if isinstance(inner, ValueError):  # our own validators' messages, as written
        return RecipeError(key, str(inner) + suffix, source)
    if first["type"] == "extra_forbidden":
        hint = did_you_mean(str(loc[-1]), _fields_at(loc)) or "; remove it (see vembed/recipe.py for every key)"
        return RecipeError(key, f"unknown key{hint}{suffix}", source)
    given = first.get("input")
    shown = repr(given) if not isinstance(given, dict) else "a mapping"
    return RecipeError(key, f"{first['msg'].lower()} (got {shown}){suffix}", source)


def recipe_from_dict(raw: dict[str, Any], source: str | None = None) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError("recipe", "must be a mapping of key: value at the top level", source)
    raw = _coerce_numbers(raw)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        raise _error_to_recipe_error(err, source) from None


def _coerce_numbers(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _coerce_numbers(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_coerce_numbers(v) for v in raw]
    return _coerce_scientific(raw)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` overrides by design
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the schema reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {first}); keep one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (safe, duplicate keys refused), apply `key=value` overrides (dotted keys reach into `data`),
    validate. A problem with an overridden key names the override, not the file."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise RecipeError("recipe", f"file {str(path)!r} {what}; pass the path of a YAML recipe (see configs/)")
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise RecipeError("recipe", "is not a text file; pass a YAML recipe (see configs/)", str(path)) from None
    except OSError as err:
        raise RecipeError("recipe", f"cannot be read: {err.strerror}", str(path)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError("recipe", f"is not valid YAML{where}: {getattr(err, 'problem', err)}", str(path)) from None
    if raw is None:
        raise RecipeError("recipe", "is empty; write the recipe's keys in it (see configs/ for examples)", str(path))
    if not isinstance(raw, dict):
        raise RecipeError("recipe", "must be a mapping of key: value at the top level", str(path))
    overrides = overrides or []
    raw = apply_overrides(raw, overrides)
    try:
        return recipe_from_dict(raw, str(path))
    except RecipeError as err:
        override = _override_of(err.key, overrides)
        if override is None:
            raise
        raise RecipeError(err.key, err.message, f"--config_override {override}") from None


def _override_of(key: str, overrides: list[str]) -> str | None:
    """The override that set `key` (or a key above or below it), if any: the last one wins, as when applying."""
    for text in reversed(overrides):
        name = text.split("=", 1)[0].strip()
        if key == name or key.startswith(f"{name}.") or name.startswith(f"{key}."):
            return text
    return None


# --- checks that need the registries or the file system ------------------------------------------------------------


def _check_data_paths(recipe: Recipe, splits: tuple[str, ...]) -> None:
    from vembed.data.sources import resolve_files  # data owns what counts as a source

    for split in splits:
        value = getattr(recipe.data, split)
        if value is None:
            continue
        resolve_files(value, recipe.data.format, key=f"data.{split}")
    if recipe.data.image_root is not None and not Path(recipe.data.image_root).is_dir():
        raise RecipeError("data.image_root", f"directory {recipe.data.image_root!r} not found")


def _check_trackers(recipe: Recipe) -> None:
    # accelerate drops a tracker whose package is missing with only a log line; a user asked for it, so refuse.
    import importlib.util

    for tracker in recipe.report_to:
        if importlib.util.find_spec(tracker) is None:
            raise RecipeError("report_to", f"{tracker} is not installed; pip install 'vembed[{tracker}]' or remove it")


def check_recipe(recipe: Recipe, *, for_training: bool = True) -> None:
    """Every check that needs more than the schema, still before any model is built."""
    from vembed.tasks import task_for

    task = task_for(recipe)  # the model and loss exist and train the same task (contrastive, flow matching)
    if for_training and recipe.data.train is None:
        raise RecipeError("data.train", "is required for training; point it at a JSONL/CSV/Parquet file or directory")
    _check_trackers(recipe)
    task.check_recipe(recipe, for_training=for_training)  # data files, model config, task-specific keys
