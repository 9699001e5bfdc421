"""The recipe: one typed schema, the only home of defaults, plus YAML loading, overrides and saving.

The recipe's own keys (data, optimisation, strategies, checkpoints, logging) are declared here. The keys of the
adapter (`model_type`) and of the loss (`loss_type`) are declared beside them, each as a `Settings` class
(`vembed/models/clip.py`, `vembed/losses/contrastive.py`, ...), and typed by it into `recipe.model` / `recipe.loss`.
YAML stays flat: `pooling: cls` sits beside `learning_rate`. This module imports nothing above it, so it cannot look
the components up itself: `recipe_from_dict` and `load_recipe` take a `Catalog` of them, and
`vembed.components.load_recipe` passes the registries' (what everything else calls).

Loading is the first stage of a recipe's validation: keys, types and ranges (pydantic, `extra="forbid"`) and the
combinations of the recipe's own keys, the first problem turned into a `RecipeError` naming the key path and the fix;
a key that belongs to another adapter or loss than the recipe's names its owner, a key of the toolkit vembed replaces
names vembed's. Every later stage (the data files, the model's config, the task's and the launch's rules), and where
each rule lives, is listed in `vembed/recipe_checks.py`.
"""

from __future__ import annotations

import os
import re
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from vembed.errors import RecipeError, did_you_mean

TRACKERS = ("tensorboard", "wandb", "trackio")

# Keys of the recipe format of the toolkit vembed replaces (and of transformers' TrainingArguments), with vembed's
# way to say the same: a person migrating a recipe gets a pointer instead of "unknown key".
RENAMED_KEYS: dict[str, str] = {
    "lr": "learning_rate",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "train_batch_size": "batch_size",
    "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size",
    "lr_scheduler_type": "scheduler_type",
    "scheduler": "scheduler_type",
    "warmup_steps": "warmup_ratio (a share of the optimizer steps, e.g. 0.05)",
    "model_path": "model_name",
    "model_name_or_path": "model_name",
    "train_file": "data.train",
    "train_data": "data.train",
    "validation_file": "data.validation",
    "eval_file": "data.validation",
    "test_file": "data.test",
    "temp": "temperature",
    "matryoshka_dims": "mrl_dims",
    "use_mixed_precision": "mixed_precision (no, fp16 or bf16)",
    "fp16": "mixed_precision: fp16",
    "bf16": "mixed_precision: bf16",
    "fsdp_mixed_precision": "mixed_precision (no, fp16 or bf16)",
    "gradient_cache_chunks": "gradient_cache_chunk_size (samples per chunk)",
    "chunk_size": "gradient_cache_chunk_size (samples per chunk)",
    "use_heun": "flow.sampler: heun",
    "num_inference_steps": "flow.num_steps",
    "fsdp_cpu_offload": "fsdp_offload_params: true in an accelerate FSDP config (accelerate_configs/fsdp.yaml)",
    "cpu_offload": "fsdp_offload_params: true in an accelerate FSDP config (accelerate_configs/fsdp.yaml)",
    "fsdp_sharding_strategy": "the accelerate config (accelerate_configs/fsdp.yaml); the recipe's use_fsdp picks it",
    "deepspeed": "an accelerate DeepSpeed config: accelerate launch --config_file accelerate_configs/zero2.yaml",
    "deepspeed_config": "an accelerate DeepSpeed config: accelerate launch --config_file accelerate_configs/zero2.yaml",
    "create_dummy_data": "`vembed data dummy --out DIR` (then point data.train at it)",
    "num_dummy_samples": "`vembed data dummy --out DIR --num-samples N`",
}


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


class Settings(_Strict):
    """The recipe keys one component (an adapter, a loss) reads, declared beside it as a subclass; flat in YAML.

    Field comments are the reference documentation of each key, as in `Recipe`. Every embedding adapter's settings
    derive from `vembed.models.base.AdapterSettings`; a key no class of the recipe's components declares is refused,
    naming the component it belongs to."""

    # Recipe keys (declared in `Recipe`) whose default this component changes when the recipe leaves them out.
    recipe_defaults: ClassVar[dict[str, Any]] = {}

    def explicit(self, key: str) -> bool:
        """Whether the recipe set `key` itself (rather than leaving the default)."""
        return key in self.model_fields_set


class Catalog(Protocol):
    """What the registries know, handed to the parser (this module imports nothing above it):
    `settings_for("model_type", "clip")` is that adapter's Settings class (a RecipeError for an unknown name), and
    `owners_of("pooling")` the components declaring a key, e.g. `{"model_type": ["composed", "text"]}`."""

    def settings_for(self, selector: str, name: str) -> type[Settings]: ...

    def owners_of(self, key: str) -> dict[str, list[str]]: ...


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
    # A ranked candidate list per query (a file with it and no positive column): the first is the positive, the rest
    # the hard negatives; its teacher scores are in data.columns.score, else `scores` (vembed/data/candidate_lists.py).
    documents: str = "documents"
    label: str = "label"  # optional group id: items sharing it count as relevant in evaluation
    # Graded pairs and distillation: a number per pair (cosent, angle, cosine_mse; margin_mse: the teacher's margin
    # with one negative), or a list of teacher scores of [positive, negative 1, ...] (distill_kl, margin_mse), one
    # per hard negative of the row plus one. Read only by losses that use scores; similarity evaluation reads it too.
    score: str = "score"


DataFormat = Literal["auto", "jsonl", "json", "csv", "parquet", "hf", "shards"]


class SourceConfig(_Strict):
    """One named source of a split (`data.train: {name: ...}`): its files and how they are read. Unset keys take the
    `data.` value (for validation/test sources: the same-named training source's first). Several training sources
    mix in one run, one source per batch, so in-batch negatives come from the same task."""

    files: str | list[str]  # a file, glob, directory, or a list of them (as data.train)
    format: DataFormat | None = None
    columns: ColumnMap | None = None
    image_root: str | None = None
    num_hard_negatives: int | None = Field(default=None, ge=0)
    # Share of the training steps drawn from this source; set it on every training source or on none (then each
    # source gets steps in proportion to its rows, every row once per epoch).
    weight: float | None = Field(default=None, gt=0)
    # Text put before every query of this source (any text model): E5's "query: ", a BGE/Qwen3-Embedding task
    # instruction such as "Instruct: Given a question, retrieve passages that answer it\nQuery: ".
    query_prompt: str | None = None
    # qwen_vl: the system-turn instruction of this source's queries (instead of the recipe's query_instruction).
    query_instruction: str | None = None
    # A corpus folder (`files`: a folder with corpus.jsonl, queries.jsonl, qrels/): which qrels/<split>.tsv judges
    # this source. Unset: data.qrels_splits of the split the source is in.
    qrels_split: str | None = None


SplitValue = str | list[str] | dict[str, SourceConfig] | None


class FirstStageRuns(_Strict):
    """Rerankers: the first stage's TREC run file on each held-out corpus folder (`data.first_stage_run: {validation:
    PATH, test: PATH}`; a bare path is data.validation's run)."""

    validation: str | None = None
    test: str | None = None


class QrelsSplits(_Strict):
    """Which qrels/<name>.tsv of a corpus folder (vembed/data/corpus.py) each data split reads, when it names one.
    No fallback: a folder without the named file is an error listing the splits it has (BEIR sets without dev, such
    as SciFact, must say `validation: test` on purpose: choosing the best checkpoint on test leaks the test set)."""

    train: str = "train"
    validation: str = "dev"
    test: str = "test"


class DataConfig(_Strict):
    """Where the pairs come from. A split is a file, a glob, a directory, a list of them, or a mapping of named
    sources (`{name: files}` or `{name: {files: ..., weight: ..., columns: ...}}`, see `SourceConfig`)."""

    train: SplitValue = None
    validation: SplitValue = None  # named sources here are evaluated one by one (metrics per source and their mean)
    test: SplitValue = None
    # auto: from the file extension (.jsonl/.json, .csv, .parquet); hf: any local `datasets.load_dataset` path;
    # shards: a directory written by `vembed extract` (paired teacher embeddings; what blip3o_dit trains on).
    format: DataFormat = "auto"
    columns: ColumnMap = Field(default_factory=ColumnMap)
    # Relative image paths are resolved against this directory; unset: the directory of the data file.
    image_root: str | None = None
    # Hard negatives per record; unset: the smallest number any training record has (0 when none have any).
    num_hard_negatives: int | None = Field(default=None, ge=0)
    # [low, high]: every score of data.columns.score must lie in it (a row outside stops the run, naming it); unset:
    # any number. E.g. [0, 1] for cosine_mse, [0, 5] for STS-B's gold scores.
    score_range: tuple[float, float] | None = None
    # Rows that are empty or point at missing/corrupt images are skipped and counted; above this share, stop.
    max_bad_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    num_workers: int = Field(default=0, ge=0)
    # Training images decoded, resized and cropped once into a memory-mapped uint8 file (one per node, keyed by the
    # files' path/size/mtime and the processor's settings), normalised per batch: the same pixel values, bit for bit,
    # without per-image work every epoch. clip, siglip and composed (fixed image size); qwen_vl decodes as before.
    image_cache: bool = True
    image_cache_dir: str | None = None  # where the cache files go; unset: $XDG_CACHE_HOME/vembed/images (~/.cache)
    # Read data.train as a stream (vembed/data/streaming.py): WebDataset tar shards, or JSONL/CSV/Parquet files, for
    # corpora larger than a disk or memory. Unset: on exactly when data.train names .tar shards.
    streaming: bool | None = None
    # Streaming: samples each reader (rank x worker) holds to shuffle its shards' samples; more mixes better, costs
    # memory (a few hundred KB per image sample) and start-up time (the buffer fills before the first batch).
    shuffle_buffer: int = Field(default=1000, gt=0)
    # Evaluate on at most this many records per split (per source, for named sources; unset: all).
    eval_max_samples: int | None = Field(default=None, gt=0)
    # Keep records sharing a text or image (query, positive or negative) out of one contrastive batch (all ranks
    # together), as sentence-transformers' no-duplicates sampler: a duplicate would be a false in-batch negative.
    no_duplicates: bool = False
    # Labelled images (metric learning, classification): every batch holds this many images of each class it draws
    # (class-balanced batches, as pytorch-metric-learning's MPerClassSampler), so a pair-based loss always finds
    # positives; batch_size must be a multiple of it. Unset: a plain shuffle.
    m_per_class: int | None = Field(default=None, ge=2)
    # Records sharing a `label` (data.columns.label) are not each other's in-batch negatives (InfoNCE, SigLIP): with
    # 10 classes at batch 64, most in-batch "negatives" would otherwise be the same class.
    mask_same_label: bool = True
    # Corpus folders (BEIR layout: corpus.jsonl, queries.jsonl, qrels/<split>.tsv) given as data.train/validation/test
    # are recognised by their files; this names the qrels split each reads (a named source: its own qrels_split).
    qrels_splits: QrelsSplits = Field(default_factory=QrelsSplits)
    # data.train as a corpus folder: mined hard negatives by id, a JSONL of {"query_id", "positive_id" (or a list
    # "positive_ids", or neither: every positive of the query), "negative_ids": [...]} (what `mine` writes); each
    # record keeps num_hard_negatives of its row's (pairs with fewer are skipped and counted).
    hard_negatives: str | None = None
    # Rerankers: TREC run files of the first stage (the embedder's top candidates) on the held-out corpus folders, a
    # path (data.validation's) or {validation: PATH, test: PATH}; evaluation reranks each query's top 100 and reports
    # before and after (validation before training, every eval_steps and at the end; test at the end).
    first_stage_run: str | FirstStageRuns | None = None

    @field_validator("train", "validation", "test", mode="before")
    @classmethod
    def _named_sources(cls, value: Any) -> Any:
        # `{name: files}` is short for `{name: {files: files}}`.
        if isinstance(value, dict):
            return {name: {"files": v} if isinstance(v, (str, list)) else v for name, v in value.items()}
        return value

    @field_validator("score_range")
    @classmethod
    def _ordered_range(cls, value: Any) -> Any:
        if value is not None and value[0] > value[1]:
            raise ValueError(f"is [{value[0]}, {value[1]}]; give [low, high] with low <= high")
        return value

    @model_validator(mode="after")
    def _source_checks(self) -> "DataConfig":
        for split in ("train", "validation", "test"):
            value = getattr(self, split)
            if isinstance(value, dict) and not value:
                raise _KeyError(f"data.{split}", "is an empty mapping; name at least one source or give a file")
        if isinstance(self.train, dict):
            weighted = [name for name, source in self.train.items() if source.weight is not None]
            if weighted and len(weighted) != len(self.train):
                unweighted = [name for name in self.train if name not in weighted]
                raise _KeyError(f"data.train.{unweighted[0]}.weight",
                                f"is unset while {weighted} set a weight; set a weight on every source or on none "
                                "(none: steps in proportion to each source's rows)")
        for split in ("validation", "test"):
            value = getattr(self, split)
            if isinstance(value, dict):
                for name, source in value.items():
                    if source.weight is not None:
                        raise _KeyError(f"data.{split}.{name}.weight", "only training sources have a weight")
        return self

    def first_stage_run_of(self, split: str) -> tuple[str, str | None]:
        """The recipe key of `split`'s first-stage run file ("validation"/"test") and the file (None: unset)."""
        runs = self.first_stage_run
        if isinstance(runs, FirstStageRuns):
            return f"data.first_stage_run.{split}", getattr(runs, split)
        if split == "validation":
            return "data.first_stage_run", runs
        return f"data.first_stage_run.{split}", None

    def sources(self, split: str) -> "dict[str, SourceConfig] | None":
        """The named sources of `split` with every unset key filled (own value, then the same-named training
        source's, then `data.`'s); None when the split is not a mapping of sources."""
        value = getattr(self, split)
        if not isinstance(value, dict):
            return None
        train = self.train if isinstance(self.train, dict) else {}
        filled = {}
        for name, source in value.items():
            parent = train.get(name) if split != "train" else None
            def pick(key: str, default: Any) -> Any:
                own = getattr(source, key)
                if own is not None:
                    return own
                inherited = getattr(parent, key) if parent is not None else None
                return inherited if inherited is not None else default
            filled[name] = SourceConfig(
                files=source.files, format=pick("format", self.format), columns=pick("columns", self.columns),
                image_root=pick("image_root", self.image_root),
                num_hard_negatives=pick("num_hard_negatives", self.num_hard_negatives), weight=source.weight,
                query_prompt=pick("query_prompt", None), query_instruction=pick("query_instruction", None),
                qrels_split=source.qrels_split or getattr(self.qrels_splits, split),
            )
        return filled


class StageConfig(_Strict):
    """One curriculum stage (`stages:`). Stages run in order on the same model and optimizer state; each key set
    here replaces the recipe's for this stage only (unset: the recipe's value, not the previous stage's). Each stage
    has its own learning-rate schedule (the recipe's scheduler_type and warmup_ratio over the stage's steps)."""

    name: str | None = None  # shown in the log; unset: stage-<number>
    epochs: int | None = Field(default=None, gt=0)  # unset: the recipe's epochs
    max_steps: int | None = Field(default=None, gt=0)  # optimizer steps of this stage; overrides epochs
    learning_rate: float | None = Field(default=None, gt=0)  # peak learning rate of this stage
    # Which named training sources (data.train: {name: ...}) this stage draws from: a list (steps in proportion to
    # their rows) or a mapping name -> weight. Unset: every source, as the recipe draws them.
    sources: list[str] | dict[str, float] | None = None
    max_length: int | None = Field(default=None, gt=0)  # tokens per text in this stage
    min_pixels: int | None = Field(default=None, gt=0)  # qwen_vl: the image-size budget of this stage ...
    max_pixels: int | None = Field(default=None, gt=0)  # ... (models with a fixed image size refuse these)

    @field_validator("sources")
    @classmethod
    def _weights(cls, value: Any) -> Any:
        if isinstance(value, dict):
            if any(weight < 0 for weight in value.values()):
                raise ValueError(f"weights must be >= 0, got {value}")
            if not any(weight > 0 for weight in value.values()):
                raise ValueError("give at least one source a weight above 0")
        if isinstance(value, list) and not value:
            raise ValueError("is an empty list; name at least one source or remove the key")
        return value


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


class AugmentationConfig(_Strict):
    """`augmentation:` — training images of the image-only tasks (classification), drawn per (seed, epoch, sample)
    so resume replays them (vembed/classification/augment.py). Off by default; evaluation images are never augmented."""

    # Random resized crop: the crop covers this fraction range of the image's area (ViT recipes: [0.08, 1.0]) with an
    # aspect ratio in crop_ratio; the adapter's processor then resizes it to the model's size. Unset: no crop.
    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    horizontal_flip: float = Field(default=0.0, ge=0.0, le=1.0)  # probability of a left-right flip
    # TrivialAugment ("wide"): one of 14 operations (shears, translations, rotation, brightness, colour, contrast,
    # sharpness, posterize, solarize, autocontrast, equalize, identity) at a random strength, on every image.
    trivial_augment: bool = False
    # Probability of erasing a random rectangle (2-33% of the image) with random colours (random erasing).
    random_erasing: float = Field(default=0.0, ge=0.0, le=1.0)
    # Mixup / cutmix on each batch (Beta(alpha, alpha) mixing weight; 0: off; both on: one per batch, even odds).
    mixup_alpha: float = Field(default=0.0, ge=0.0)
    cutmix_alpha: float = Field(default=0.0, ge=0.0)

    @field_validator("crop_scale", "crop_ratio")
    @classmethod
    def _ordered_range(cls, value: tuple[float, float] | None, info) -> tuple[float, float] | None:
        if value is None:
            return value
        low, high = value
        upper = 1.0 if info.field_name == "crop_scale" else float("inf")
        if not 0 < low <= high <= upper:
            bound = "0 < low <= high <= 1" if upper == 1.0 else "0 < low <= high"
            raise ValueError(f"must be [low, high] with {bound}, got {list(value)}")
        return value

    @property
    def enabled(self) -> bool:
        return (self.crop_scale is not None or self.horizontal_flip > 0 or self.mixup_alpha > 0
                or self.cutmix_alpha > 0 or self.trivial_augment or self.random_erasing > 0)


class Recipe(_Strict):
    """Everything a training run needs. Field comments are the reference documentation of each key; the keys of the
    adapter and the loss are documented in their Settings classes (see the module docstring)."""

    # --- what to train -------------------------------------------------------------------------------------------
    # The adapter (its keys: `recipe.model`): clip, siglip, text, composed, qwen_vl; blip3o_dit (a generator).
    model_type: str = "clip"
    # The loss (its keys: `recipe.loss`): infonce, siglip (embedding models); flow_matching (blip3o_dit).
    loss_type: str = "infonce"
    # The recipe's adapter and loss settings, typed by their owners' Settings classes (`vembed.components` fills
    # them from the flat keys); `recipe.model.pooling`, `recipe.loss.temperature`.
    model: SerializeAsAny[Settings]
    loss: SerializeAsAny[Settings]

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
    # Layer-wise learning-rate decay (ViT/BERT fine-tuning): the top layer (and heads, the loss) train at
    # learning_rate, each layer below at this factor times the one above, the embeddings lowest. Unset: one rate.
    layer_lr_decay: float | None = Field(default=None, gt=0, le=1)
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0)  # optimizer steps; when set, it overrides epochs
    # Curriculum: stages trained one after another (see StageConfig); unset: one stage made of the keys above.
    stages: list[StageConfig] | None = None
    scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)  # cosine and linear only: constant has no warmup
    max_grad_norm: float | None = Field(default=1.0, gt=0)  # unset: no clipping
    # An exponential moving average of the trained weights, updated after every optimizer step with this decay
    # (timm's model EMA; 0.999-0.9999 is usual): evaluations and final/ use it in place of the last step's weights,
    # checkpoints keep it. Unset: none. Single process and DDP (FSDP and DeepSpeed shard the weights).
    ema_decay: float | None = Field(default=None, gt=0, lt=1)
    # Plain accumulation averages gradients of several batches; it does NOT add negatives to the contrastive batch
    # (use use_gradient_cache for that).
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    gradient_checkpointing: bool = False
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None  # unset: what the accelerate config says
    seed: int = 42

    # --- LoRA ------------------------------------------------------------------------------------------------------
    use_lora: bool = False
    lora_r: int = Field(default=16, gt=0)  # qwen_vl: 32, the released Qwen3-VL-Embedding LoRA's rank
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
    # Length-aware encoding: each text side of a step runs as this many length-sorted forwards, each padded only to
    # its own longest text; embeddings go back in batch order before the loss (same batch). With dropout off, the
    # padded step's loss and gradients up to float rounding; with dropout on (released encoders' default), the chunks
    # draw their masks in another order: another draw of the same distribution, not the padded step (deterministic
    # given the seed; resumes bitwise). 1: one forward padded to the batch's longest text. Helps where lengths are
    # uneven; adapters whose pooling depends on padding (siglip) and qwen_vl ignore it. Under GradCache each chunk
    # is cut to its longest.
    length_chunks: int = Field(default=1, ge=1)
    # torch.compile each encoder tower the adapter names (`compiled_modules`), in place: same weights and state dict,
    # the first steps (and each new input shape) pay the compilation. Tested equal to eager in one process, with
    # GradCache, with LoRA and under DDP; FSDP and DeepSpeed are refused (vembed/training/launch_plan.py says why).
    compile: bool = False
    # FSDP2 (sharded weights, gradients, optimizer state): run.py / `vembed train` launch accelerate_configs/fsdp.yaml;
    # with `accelerate launch`, pass an FSDP config yourself (the run refuses a launch that is not FSDP).
    use_fsdp: bool = False

    # --- checkpoints, evaluation, logging --------------------------------------------------------------------------
    logging_steps: int = Field(default=10, gt=0)
    save_steps: int | None = Field(default=500, gt=0)  # unset: no intermediate checkpoints
    save_total_limit: int = Field(default=2, gt=0)  # recent checkpoints kept, besides the best one
    eval_steps: int | None = Field(default=None, gt=0)  # unset: evaluate at the end of each epoch
    eval_before_training: bool = True  # record the untrained model's metrics for comparison
    metric_for_best_model: str = "q2d/accuracy@1"  # validation metric that picks the best checkpoint (higher: better)
    # Every log line also records samples/s, tokens/s, peak memory and MFU (vembed/training/throughput.py).
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(default_factory=list)
    run_name: str | None = None
    # "auto": the newest good checkpoint in output_dir (damaged ones are skipped, naming the bad file; another run's
    # are refused), or a fresh start when there is none; or a checkpoint path. Unset: a new run, refused when
    # output_dir already holds checkpoints or a final model.
    resume_from: str | None = None
    overwrite_output_dir: bool = False  # start again in an output_dir holding a run: its outputs are removed first

    # --- image-only tasks -----------------------------------------------------------------------------------------
    augmentation: AugmentationConfig = Field(default_factory=AugmentationConfig)

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
        if self.stages is not None:
            self._check_stages()
        if self.gradient_cache_chunk_size is not None and self.use_gradient_cache is False:
            raise InvalidKey("gradient_cache_chunk_size", "is set but use_gradient_cache is false; set it to true")
        if self.scheduler_type == "constant" and self.warmup_ratio > 0:
            raise InvalidKey("warmup_ratio", "does nothing with scheduler_type constant (no warmup); use cosine or "
                                             "linear, or remove warmup_ratio")
        return self

    def _check_stages(self) -> None:
        if not self.stages:
            raise _KeyError("stages", "is an empty list; list at least one stage or remove the key")
        named = list(self.data.train) if isinstance(self.data.train, dict) else []
        for number, stage in enumerate(self.stages):
            unknown = [name for name in stage.sources or () if name not in named]
            if unknown:
                known = f"data.train names {named}" if named else "data.train is not a mapping of named sources"
                raise _KeyError(f"stages.{number}.sources",
                                f"names {unknown}{did_you_mean(unknown[0], named)}, but {known}")
            built_low, built_high = getattr(self.model, "min_pixels", None), getattr(self.model, "max_pixels", None)
            low, high = stage.min_pixels or built_low, stage.max_pixels or built_high
            if low is not None and high is not None and low > high:
                raise _KeyError(f"stages.{number}.min_pixels", f"{low} exceeds max_pixels {high}")

    # --- helpers ---------------------------------------------------------------------------------------------------
    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.batch_size

    def to_dict(self) -> dict[str, Any]:
        """The flat key: value mapping of the YAML (the adapter's and the loss's keys beside the recipe's own)."""
        raw = self.model_dump(mode="json", by_alias=True, exclude={"model", "loss"})
        for part in (self.model, self.loss):
            raw.update(part.model_dump(mode="json", by_alias=True))
        return raw

    def save(self, path: str | os.PathLike) -> None:
        """Write the resolved recipe (defaults and overrides applied) as YAML, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        tmp.replace(path)


class InvalidKey(ValueError):
    """Raised inside validators (of the recipe or of a component's Settings) so the error names the key it is
    about, not the model."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}")


_KeyError = InvalidKey  # the name validators in this module used before Settings classes could raise it too

# The keys declared by Recipe itself (not by a component), as written in YAML.
RECIPE_KEYS = tuple(field.alias or name for name, field in Recipe.model_fields.items() if name not in ("model", "loss"))
SELECTORS = {"model_type": "model", "loss_type": "loss"}  # the key choosing a component -> where its settings go


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


def _fields_at(root: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """Names of the keys valid at the level of `loc` under `root` (for 'did you mean'), through nested sections,
    named sources (`data.train.<name>.`) and list items (`stages.<n>.`)."""
    model = root
    parts = list(loc[:-1])
    while parts:
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == str(parts[0])), None)
        found = _section_model(getattr(field, "annotation", None))
        if found is None:
            return []
        model, keyed = found
        parts = parts[2:] if keyed else parts[1:]  # a keyed section (list item, named source) also takes a key
    return [field.alias or name for name, field in model.model_fields.items()]


def _section_model(annotation: Any, keyed: bool = False) -> tuple[type[BaseModel], bool] | None:
    """The pydantic model a field holds, and whether it sits in a list or mapping (one more key in the path)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, keyed
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        found = _section_model(arg, keyed or origin in (list, dict))
        if found is not None:
            return found
    return None


# pydantic names the member of a union (`str`, `list[str]`, `dict[str,SourceConfig]`) or the validator in an error's
# location; no key is.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z_-]+\[.*\])$")


def _key_path(error: dict[str, Any]) -> tuple[str | int, ...]:
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":  # the last part is the user's unknown key, whatever it is called
        return tuple(p for p in loc[:-1] if not (isinstance(p, str) and _TYPE_TAG.match(p))) + loc[-1:]
    return tuple(p for p in loc if not (isinstance(p, str) and _TYPE_TAG.match(p)))


def _error_to_recipe_error(err: ValidationError, source: str | None, root: type[BaseModel]) -> RecipeError:
    # A key that takes one of several types (data.train: files or named sources) fails once per type; the error that
    # reached deepest into the value is the one about what the user wrote. An unknown key explains a missing one
    # beside it (`filez` for `files`), so it wins a tie.
    first = max(err.errors(), key=lambda error: (len(_key_path(error)), error["type"] == "extra_forbidden"))
    loc = _key_path(first)
    key = ".".join(str(p) for p in loc) or "recipe"
    # A union reports each member, and the members' errors above the chosen key are its alternatives: one problem.
    more = len({path for path in map(_key_path, err.errors()) if path != loc and path != loc[:len(path)]})
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    ctx = first.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, InvalidKey):
        return RecipeError(inner.key, inner.message + suffix, source)
    if isinstance(inner, ValueError):  # our own validators' messages, as written
        return RecipeError(key, str(inner) + suffix, source)
    if first["type"] == "extra_forbidden":
        hint = did_you_mean(str(loc[-1]), _fields_at(root, loc)) or "; remove it (see vembed/recipe.py for every key)"
        return RecipeError(key, f"unknown key{hint}{suffix}", source)
    given = first.get("input")
    shown = repr(given) if not isinstance(given, dict) else "a mapping"
    return RecipeError(key, f"{first['msg'].lower()} (got {shown}){suffix}", source)


def _validate(model: type[BaseModel], raw: dict[str, Any], source: str | None) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise _error_to_recipe_error(err, source, model) from None


def _foreign_key(
    key: str, chosen: dict[str, str], known: list[str], catalog: Catalog, source: str | None
) -> RecipeError:
    """The error for a top-level key that neither the recipe nor its chosen components declare."""
    owners = catalog.owners_of(key)
    if owners:
        selector, names = next(iter(owners.items()))
        article = "an" if names[0][0] in "aeiou" else "a"
        return RecipeError(key, f"is {article} {' / '.join(names)} setting; this recipe's {selector} is "
                                f"{chosen[selector]} (remove {key}, or choose {selector}: {names[0]})", source)
    if key in RENAMED_KEYS:
        return RecipeError(key, f"is not a vembed key; did you mean {RENAMED_KEYS[key]}?", source)
    hint = did_you_mean(key, known) or "; remove it (see vembed/recipe.py and the adapters' and losses' Settings)"
    return RecipeError(key, f"unknown key{hint}", source)


def recipe_from_dict(raw: dict[str, Any], source: str | None, catalog: Catalog) -> Recipe:
    """Validate a flat recipe mapping: the recipe's own keys here, the adapter's and the loss's keys by the Settings
    classes `catalog` names for `model_type` and `loss_type`. Callers pass the registries' catalog; most use
    `vembed.components.recipe_from_dict`, which does."""
    if not isinstance(raw, dict):
        raise RecipeError("recipe", "must be a mapping of key: value at the top level", source)
    raw = _coerce_numbers(raw)
    chosen: dict[str, str] = {}
    classes: dict[str, type[Settings]] = {}
    for selector in SELECTORS:
        name = raw.get(selector, Recipe.model_fields[selector].default)
        if not isinstance(name, str):
            raise RecipeError(selector, f"must be a name (got {name!r})", source)
        chosen[selector] = name
        try:
            classes[selector] = catalog.settings_for(selector, name)
        except RecipeError as err:
            raise RecipeError(err.key, err.message, source) from None
    own: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {selector: {} for selector in SELECTORS}
    component_keys = {selector: _fields_at(cls, ("",)) for selector, cls in classes.items()}
    for key, value in raw.items():
        owner = next((selector for selector, keys in component_keys.items() if key in keys), None)
        if owner is not None:
            parts[owner][key] = value
        elif key in RECIPE_KEYS:
            own[key] = value
        else:
            known = [*RECIPE_KEYS, *(k for keys in component_keys.values() for k in keys)]
            raise _foreign_key(str(key), chosen, known, catalog, source)
    settings = {SELECTORS[selector]: _validate(classes[selector], parts[selector], source) for selector in SELECTORS}
    defaults = {k: v for cls in classes.values() for k, v in cls.recipe_defaults.items()}
    return _validate(Recipe, {**defaults, **own, **settings}, source)


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


def read_recipe_file(path: str | os.PathLike, overrides: list[str] | None = None) -> dict[str, Any]:
    """The mapping of a YAML recipe (safe, duplicate keys refused) with `key=value` overrides applied (dotted keys
    reach into `data`)."""
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
    return apply_overrides(raw, overrides or [])


def load_recipe(path: str | os.PathLike, overrides: list[str] | None, catalog: Catalog) -> Recipe:
    """Read a YAML recipe, apply overrides, validate (see `recipe_from_dict`). A problem with an overridden key names
    the override, not the file."""
    overrides = overrides or []
    raw = read_recipe_file(path, overrides)
    try:
        return recipe_from_dict(raw, str(path), catalog)
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
