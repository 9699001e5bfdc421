"""Contrastive retrieval: embedding adapters trained on (query, positive, negatives) pairs, measured by retrieval."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vembed.errors import DataError, RecipeError, did_you_mean
from vembed.losses.base import EmbeddingLoss
from vembed.models.base import EmbeddingAdapter
from vembed.models.splade import IDF
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

    from accelerate import Accelerator

    from vembed.data.corpus import CorpusSplit
    from vembed.data.image_cache import ImageCache
    from vembed.data.records import Example
    from vembed.data.teacher_embeddings import TeacherEmbeddings

    EvalData = list[Example] | CorpusSplit
    from vembed.recipe import Recipe
    from vembed.training.stages import Stage

logger = logging.getLogger(__name__)


class ContrastiveObjective(nn.Module):
    """The trainable unit: an adapter and its loss in one module, so the strategy wraps (DDP, ...) both at once. A
    learnable temperature or SigLIP bias lives in the loss; keeping the loss inside the wrapped module is what makes
    DDP average its gradient like every other parameter."""

    def __init__(self, adapter: EmbeddingAdapter, loss: EmbeddingLoss, length_chunks: int = 1,
                 guide: EmbeddingAdapter | None = None):
        super().__init__()
        self.adapter = adapter
        self.loss = loss
        self.length_chunks = length_chunks if adapter.length_chunking else 1
        # GISTEmbed's frozen guide: kept out of the module tree, so no wrapper syncs, shards or saves it.
        self.__dict__["guide"] = guide

    def loss_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What the loss takes from a batch besides the embeddings: labels, scores and, for GISTEmbed, the guide's
        embeddings of every side (computed once per batch, without a graph)."""
        inputs = {"labels": batch.get("label_ids"), "scores": batch.get("scores")}
        if "teacher" in batch:  # a teacher's extracted embeddings of the rows (embedding_mse)
            inputs["teacher"] = batch["teacher"]
        if self.guide is not None:
            sides = batch["guide"]
            device = next(p.device for p in self.adapter.parameters())
            self.guide.to(device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                embedded = {side: self.guide(inputs).float() for side, inputs in sides.items()}
            k = int(batch.get("num_negatives") or 0)
            negative = embedded["negative"].view(embedded["query"].shape[0], k, -1) if k else None
            inputs["guide"] = (embedded["query"], embedded["positive"], negative)
        return inputs

    def encode_side(self, inputs: dict[str, Any]) -> torch.Tensor:
        """One side's embeddings, through the adapter's call (see `embed`), length-aware where it applies."""
        if not self.adapter.length_chunking:
            return self.adapter(inputs)
        from vembed.models.length_chunks import encode_by_length

        return encode_by_length(self.adapter, inputs, self.length_chunks)

    def embed(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Query, positive and (B, k, d) hard-negative embeddings of a collated batch.

        The adapter is called (its `forward` is `encode`), never `.encode` directly: wrappers that hook the call,
        such as an FSDP unit gathering its weights, must see it."""
        negatives = self.encode_side(batch["negative"]) if batch.get("num_negatives") else None
        return self.shape_embeddings(
            self.encode_side(batch["query"]), self.encode_side(batch["positive"]), negatives,
            int(batch.get("num_negatives") or 0),
        )

    @staticmethod
    def shape_embeddings(
        query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None, num_negatives: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if negatives is None or num_negatives == 0:
            return query, positive, None
        # (B, k, d); token vectors (B*k, T, d) become (B, k, T, d)
        return query, positive, negatives.view(query.shape[0], num_negatives, *negatives.shape[1:])

    def forward(self, batch: dict[str, Any] | None = None, *, encode: dict[str, Any] | None = None,
                run_inside: "Callable[[ContrastiveObjective], torch.Tensor] | None" = None) -> torch.Tensor:
        """The loss of a batch; or, for evaluation (`encode`: a preprocessed batch of sides), their float32
        embeddings; or `run_inside(self)`: a pass that must run inside this module's (wrapped) forward so that DDP
        and other wrappers see it (GradCache's replays, vembed/training/grad_cache.py).

        All go through `forward` so that the wrapper (DDP, FSDP's root, DeepSpeed's engine) runs around every pass:
        ZeRO-3 gathers a parameter read outside its own module's forward only inside its engine's forward. `encode`
        is an argument, not a closure, so the wrapper sees the inputs too (DeepSpeed casts them to its dtype)."""
        if encode is not None:
            return self._encode_in_full_precision(encode)
        if run_inside is not None:
            return run_inside(self)
        return self.loss(*self.embed(batch), **self.loss_inputs(batch))

    def _encode_in_full_precision(self, inputs: dict[str, Any]) -> torch.Tensor:
        # Evaluation measures the model that is saved, as `vembed eval` runs it: in the dtype of its weights (float32;
        # only DeepSpeed's bf16/fp16 engines hold half-precision weights), whatever autocast the launch wraps the
        # forward in (accelerate's mixed precision).
        device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        with torch.autocast(device.type, enabled=False):
            return self.adapter(inputs).float()


@TASKS.register("contrastive")
class ContrastiveTask(Task):
    name = "contrastive"
    uses_gradient_cache = True
    batch_wide_loss = True
    plan_batch = "contrastive"
    image_cache: "ImageCache | None" = None  # the training images resized once, when `train_dataset` opened one
    teacher: "TeacherEmbeddings | None" = None  # embedding_mse: the teacher's vectors of the training rows

    def __init__(self, recipe: "Recipe"):
        super().__init__(recipe)
        _resolve_best_metric(recipe)
        self._split_reports: dict[str, dict[str, Any]] = {}  # held-out split -> what was read of it

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        from vembed.data.paths import check_data_paths
        from vembed.models import MODELS

        if recipe.data.format == "shards":
            raise RecipeError("data.format", f"shards hold teacher embeddings for blip3o_dit; model_type "
                                             f"{recipe.model_type!r} trains on JSONL/CSV/Parquet/hf pairs")
        from vembed.data.streaming import check_stream_recipe, held_out_shard_splits, wants_streaming

        streamed = wants_streaming(recipe.data)
        if streamed and for_training:
            _check_not_streamed(recipe)
            from vembed.components import loss_class
            from vembed.losses.inputs import required_parts

            check_stream_recipe(recipe.data, recipe.max_steps, required_parts(loss_class(recipe), recipe.loss_type))
        in_shards = held_out_shard_splits(recipe.data)  # read by load_eval_split from the shards (bounded)
        check_data_paths(recipe.data, [split for split in ("train", "validation", "test")
                                       if split not in in_shards and not (split == "train" and streamed)])
        adapter_cls = MODELS.get(recipe.model_type)
        adapter_cls.check_recipe(recipe)
        _check_source_and_stage_keys(recipe, adapter_cls)
        _check_token_vectors(recipe)
        _check_sparse(recipe)
        if getattr(recipe.loss, "gist_guide", None) is not None:
            from vembed.losses.guide import check_guide_folder

            check_guide_folder(recipe.loss.gist_guide)
        _resolve_best_metric(recipe, check=True)
        dim = adapter_cls.embedding_dim_for(recipe)  # reads the config only: a bad model_name fails here, cheaply
        if recipe.loss.mrl_dims:
            too_big = [d for d in recipe.loss.mrl_dims if d > dim]
            if too_big:
                raise RecipeError("mrl_dims",
                                  f"{too_big} exceed the embedding size {dim} of this model; use dims <= {dim}")
        if for_training and getattr(recipe.loss, "teacher_embeddings", None) is not None:
            _check_teacher_embeddings(recipe, dim, streamed)

    def load_train_data(self):
        from vembed.data.sources import load_rows
        from vembed.data.streaming import wants_streaming

        if wants_streaming(self.recipe.data):
            return self._open_train_stream()
        # Records are made when fetched; what is known of every row (images per side, modalities) comes from the
        # checks, so nothing here walks a million rows in Python.
        from vembed.components import loss_class

        # A loss that reads no hard negatives (cosent, batch_hard_triplet, ...) gets none: nothing to encode.
        unused = not getattr(loss_class(self.recipe), "uses_negatives", True)
        self.train_rows, report = load_rows(self.recipe.data, "train", num_hard_negatives=0 if unused else None)
        check_images_per_side(self.recipe.model_type, self.train_rows)
        from vembed.losses.inputs import check_loss_inputs

        check_loss_inputs(loss_class(self.recipe), self.recipe, self.train_rows)
        if getattr(loss_class(self.recipe), "needs_teacher", False):
            from vembed.data.rows import PairRows
            from vembed.data.teacher_embeddings import KEY, TeacherEmbeddings

            if not isinstance(self.train_rows, PairRows):
                raise RecipeError(KEY, "teacher embeddings are matched to the rows of pairs files; data.train is a "
                                       "corpus folder")
            self.teacher = TeacherEmbeddings(self.recipe.loss.teacher_embeddings)
            self.teacher.check_rows(self.train_rows)  # every row has its vector, of the same text: before any write
        return report

    def every_step_uses_every_parameter(self) -> bool:
        from vembed.models import MODELS

        adapter_cls = MODELS.get(self.recipe.model_type)
        if self.train_rows is None:  # streamed: records are unknown before training, unless the decoder insists
            return adapter_cls.modalities_per_record >= adapter_cls.modalities
        return self.train_rows.every_record_has(adapter_cls.modalities)

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        recipe = self.recipe
        contrastive = recipe.batch_size * world_size
        lines = [("contrastive batch", f"{contrastive} (negatives gathered across processes)"),
                 ("effective batch", f"{contrastive * recipe.gradient_accumulation_steps} per optimizer step")]
        if recipe.length_chunks > 1:
            from vembed.models import MODELS

            applies = MODELS.get(recipe.model_type).length_chunking
            lines.append(("length-aware", f"{recipe.length_chunks} length-sorted padded chunks per text side"
                          if applies else f"off: {recipe.model_type} pools where padding matters"))
        if getattr(recipe.model, "packing", False):
            lines.append(("packed", "each text side runs as one row of its real tokens (varlen flash attention on "
                                    "CUDA, each text alone elsewhere)"))
        from vembed.data.image_cache import cache_line

        return lines + cache_line(self.image_cache)

    def build_objective(self) -> "nn.Module":
        from vembed.losses import build_loss

        recipe = self.recipe
        adapter = self.build_adapter()
        if getattr(adapter.settings, "static_query", False):  # inference-free SPLADE: IDF over this run's documents
            adapter.initialise_static_query(None if self.train_rows is None else document_texts(self.train_rows))
        loss = build_loss(recipe)
        guide = None
        if getattr(loss, "needs_guide", False):
            from vembed.losses.guide import load_guide

            guide = load_guide(recipe.loss.gist_guide)
        return ContrastiveObjective(adapter, loss, recipe.length_chunks, guide)

    def train_dataset(self, objective: "nn.Module"):
        from vembed.data.collate import PairCollator
        from vembed.data.dataset import PairDataset

        if self.train_rows is None:
            return self._train_stream(objective), None
        collate = PairCollator(objective.adapter, labels=self._label_ids(), guide=objective.guide,
                               teacher=self.teacher)
        self.image_cache = self._image_cache(objective.adapter)
        return PairDataset(self.train_rows, image_cache=self.image_cache), collate

    def _label_ids(self) -> bool:
        """Batches carry label ids where the loss masks same-label negatives (data.mask_same_label) or mines on
        labels (batch_hard_triplet)."""
        from vembed.components import loss_class

        return self.recipe.data.mask_same_label or bool(getattr(loss_class(self.recipe), "needs_labels", False))

    def _image_cache(self, adapter: EmbeddingAdapter) -> "ImageCache | None":
        """The training images resized once (data.image_cache), for adapters whose images have one fixed size."""
        from vembed.data.image_cache import cache_applies, image_paths, open_image_cache

        data = self.recipe.data
        if not cache_applies(data, adapter):
            return None
        return open_image_cache(image_paths(self.train_rows, None), adapter.image_processor, data.image_cache_dir)

    def enter_stage(self, objective: "nn.Module", stage: "Stage") -> None:
        """A stage's max_length and image pixel budget (unset: the recipe's; for max_length, unset there too: the
        model's own limit, as the adapter was built with)."""
        adapter = objective.adapter
        if not hasattr(self, "_built_max_length"):
            self._built_max_length = adapter.settings.max_length
        max_length = stage.max_length if stage.max_length is not None else self._built_max_length
        adapter.settings = adapter.settings.model_copy(update={"max_length": max_length})
        if any(config.min_pixels is not None or config.max_pixels is not None for config in self.recipe.stages or ()):
            adapter.set_pixel_budget(stage.min_pixels, stage.max_pixels)

    def learning_rate_scales(self, objective: "nn.Module") -> "dict[nn.Parameter, float]":
        return objective.adapter.learning_rate_scales(self.recipe.learning_rate)

    def begin_step(self, objective: "nn.Module", step: int, total_steps: int) -> None:
        objective.loss.begin_step(step, total_steps)  # the FLOPS warmup (vembed/losses/sparse.py)

    # --- streamed training data (vembed/data/streaming.py) ----------------------------------------------------------
    def _open_train_stream(self):
        from vembed.data.streaming import StreamReport, open_stream

        self.train_rows = None
        self.stream_backend, self.stream_shards = open_stream(self.recipe.data)
        sizes = [shard.num_samples for shard in self.stream_shards]
        return StreamReport(split="train", files=[shard.path for shard in self.stream_shards],
                            backend=self.stream_backend, num_hard_negatives=self.recipe.data.num_hard_negatives or 0,
                            planned_samples=None if None in sizes else sum(sizes))

    def _train_stream(self, objective: "nn.Module"):
        from vembed.data.collate import PairCollator
        from vembed.data.stream_samples import SampleDecoder
        from vembed.data.streaming import ShardStream
        from vembed.models import MODELS

        recipe, data = self.recipe, self.recipe.data
        adapter_cls = MODELS.get(recipe.model_type)
        from vembed.components import loss_class
        from vembed.losses.inputs import record_lacks

        decoder = SampleDecoder(data.columns.model_dump(), data.image_root, data.num_hard_negatives or 0,
                                adapter_cls.max_images_per_side, required_modalities=adapter_cls.modalities_per_record,
                                lacks=record_lacks(loss_class(recipe), recipe.loss_type))
        collate = PairCollator(objective.adapter, labels=self._label_ids(), guide=objective.guide)
        return ShardStream(self.stream_backend, self.stream_shards, decoder, collate,
                           batch_size=recipe.batch_size, seed=recipe.seed, shuffle_buffer=data.shuffle_buffer)

    def held_out_images(self, data: Any) -> list[Any]:
        """Every image of a held-out split's records, or of its corpus and queries (a corpus folder); per source."""
        if isinstance(data, dict):
            return [image for part in data.values() for image in self.held_out_images(part)]
        return side_images(data)

    def load_eval_split(self, split: str) -> "EvalData | dict[str, EvalData]":
        """The records of a held-out split, or its corpus (`CorpusSplit`) where it names a corpus folder; for named
        sources, a dict name -> either (evaluated one by one). What was read is kept for the model card."""
        from vembed.data.corpus import corpus_sources
        from vembed.data.sources import load_rows
        from vembed.data.streaming import names_tar_shards

        data = self.recipe.data
        if getattr(data, split) is None:
            return []
        if names_tar_shards(getattr(data, split)):
            return self._load_eval_shards(split)
        corpora = corpus_sources(data, split)
        if None in corpora:
            corpus = corpora[None].load()
            self._split_reports[split] = _corpus_report(corpus)
            return corpus
        per_source: dict[Any, Any] = {name: corpus.load() for name, corpus in corpora.items()}
        counted: dict[str, Any] = {"split": split, "sources": {name: _corpus_report(corpus)
                                                               for name, corpus in per_source.items()}}
        pairs = {name: source for name, source in (getattr(data, split) or {}).items() if name not in corpora} \
            if corpora else None
        if pairs is None or pairs:
            pair_data = data if pairs is None else data.model_copy(update={split: pairs})
            # Negatives as many as every record of the split has (its own count, not data.num_hard_negatives, so
            # no record is skipped for too few): triplet accuracy reads the first (vembed/evaluation/scored.py).
            pair_data = pair_data.model_copy(update={"num_hard_negatives": None})
            rows, report = load_rows(pair_data, split)
            per_source.update({name: rows[start:stop] for name, start, stop in rows.source_ranges()})
            # rows read, kept and skipped, plus how many are evaluated (eval_max_samples)
            read = report.to_dict()
            if "sources" in read:
                counted["sources"].update(read["sources"])
            else:
                counted = read
        limit = data.eval_max_samples
        for name, examples in per_source.items():
            if isinstance(examples, list):
                check_images_per_side(self.recipe.model_type, examples)
                per_source[name] = examples[:limit] if limit else examples
                (counted["sources"][name] if name is not None else counted)["evaluated"] = len(per_source[name])
        if "sources" in counted:  # the recipe's order
            counted["sources"] = {name: counted["sources"][name] for name in getattr(data, split)
                                  if name in counted["sources"]}
        self._split_reports[split] = counted
        if list(per_source) == [None]:
            return per_source[None]
        return {name: per_source[name] for name in getattr(data, split) if name in per_source}  # the recipe's order

    def _load_eval_shards(self, split: str) -> "list[Example]":
        """A held-out split of tar shards: its first usable samples, up to the bound (vembed/data/streaming.py)."""
        from vembed.data.streaming import read_held_out_shards
        from vembed.models import MODELS

        examples, report = read_held_out_shards(self.recipe.data, split,
                                                MODELS.get(self.recipe.model_type).max_images_per_side)
        self._split_reports[split] = {**report.to_dict(), "evaluated": len(examples)}
        return examples

    def split_report(self, split: str) -> dict[str, Any] | None:
        """What was read of a held-out split (rows read, kept, skipped, evaluated), for the model card."""
        return self._split_reports.get(split)

    def evaluate(self, model: "nn.Module", data: "list[Example] | dict[str, list[Example]]",
                 accelerator: "Accelerator", prepared: "nn.Module | None" = None) -> dict[str, float]:
        """Retrieval metrics; for named sources, each source's own (`<source>/q2d/accuracy@1`, its queries against its
        documents, as MTEB scores each task apart) and, unprefixed, their mean over sources."""
        if isinstance(data, dict):
            from vembed.evaluation.pairs import merge_source_metrics

            return merge_source_metrics({name: self.evaluate(model, examples, accelerator, prepared)
                                         for name, examples in data.items()})
        from vembed.data.corpus import CorpusSplit
        from vembed.evaluation.pairs import evaluate_retrieval

        # Through the wrapper, as in training: ZeRO-3 gathers weights read outside their module's forward (CLIP's
        # position embedding) only inside its engine's forward (ContrastiveObjective.forward's `encode`).
        forward = None if prepared is None else lambda inputs: prepared(encode=inputs)
        if isinstance(data, CorpusSplit):
            from vembed.evaluation.corpus import evaluate_corpus

            return evaluate_corpus(model, data, batch_size=self.recipe.resolved_eval_batch_size,
                                   accelerator=accelerator, max_queries=self.recipe.data.eval_max_samples,
                                   show_progress=accelerator.is_local_main_process and len(data.corpus) >= 20000,
                                   forward=forward)
        if not data:
            return {}
        from vembed.evaluation.scored import evaluate_scored

        metrics = evaluate_retrieval(
            model,
            data,
            batch_size=self.recipe.resolved_eval_batch_size,
            mrl_dims=self.recipe.loss.mrl_dims,
            accelerator=accelerator,
            # Small sets encode in a blink; a bar for each would only bury the training bar.
            show_progress=accelerator.is_local_main_process and len(data) >= 2000,
            forward=forward,
        )
        # Graded pairs (a score column) and triplets (hard negatives): similarity and triplet metrics too.
        return {**metrics, **evaluate_scored(model, data, batch_size=self.recipe.resolved_eval_batch_size,
                                             accelerator=accelerator, forward=forward)}

    def headline(self, metrics: dict[str, float]) -> str:
        keys = ("similarity/spearman_cosine", "triplet/cosine_accuracy",
                "q2d/accuracy@1", "q2d/accuracy@5", "q2d/accuracy@10", "q2d/mrr", "d2q/accuracy@1", "corpus/ndcg@10",
                "corpus/recall@100", "corpus/mrr@10")
        return "  ".join(f"{k}={metrics[k]:.3f}" for k in keys if k in metrics)

    def plots(self, metrics: dict[str, Any], output_dir: Path) -> list[Path]:
        from vembed.evaluation.plots import plot_accuracy_vs_dim

        split = metrics.get("test") or metrics.get("validation")
        if split and self.recipe.loss.mrl_dims:
            path = plot_accuracy_vs_dim(split, output_dir / "accuracy_vs_dim.png")
            return [path] if path is not None else []
        return []


def _corpus_report(corpus: "CorpusSplit") -> dict[str, Any]:
    """A corpus split in the data report's terms: its judged queries are the rows read, kept and evaluated."""
    where = f"{corpus.folder} (qrels/{corpus.split}.tsv, {len(corpus.corpus)} documents)"
    n = len(corpus.queries)
    return {"split": corpus.split, "files": [where], "total": n, "kept": n, "skipped": {}, "evaluated": n}


def _check_not_streamed(recipe: "Recipe") -> None:
    """What needs the whole training split up front (its sources' sizes, every record's texts, each stage's length,
    its smallest count of hard negatives) is refused for streamed data, naming the key."""
    if isinstance(recipe.data.train, dict):
        raise RecipeError("data.streaming", "named sources are read memory-mapped, not streamed; set "
                                            "data.streaming: false, or stream one source (data.train: its files)")
    if recipe.data.no_duplicates:
        raise RecipeError("data.no_duplicates", "compares every record of the split before an epoch; not available "
                                                "for streamed data")
    if recipe.stages:
        raise RecipeError("stages", "are not available for streamed data yet; train the stages as separate runs "
                                    "(model_name: the previous run's final/ folder)")
    if getattr(recipe.model, "static_query", False) and recipe.model.static_query_init == IDF:
        raise RecipeError("static_query_init", "idf counts every training document before step 1, which a stream "
                                               "cannot; give an idf.json or ones, or set data.streaming: false")
    from vembed.components import loss_class

    # Read whole, a split keeps its rows' smallest count of negatives; a stream cannot know it before reading.
    needed, given = getattr(loss_class(recipe), "min_negatives", 0), recipe.data.num_hard_negatives
    if (given or 0) < needed:
        raise RecipeError("data.num_hard_negatives", f"is {'unset' if given is None else given}, and a stream keeps "
                                                     f"that many hard negatives per record (unset: none); loss_type "
                                                     f"{recipe.loss_type} reads at least {needed}; set it")


def validation_metric_names(recipe: "Recipe") -> list[str]:
    """The metric keys evaluating `data.validation` gives (without counts): a split of pairs `q2d/accuracy@1`, ...; a
    corpus folder `corpus/ndcg@10`, ...; named sources each under `<name>/` and, unprefixed, the keys they share."""
    from vembed.data.corpus import corpus_sources
    from vembed.evaluation.corpus import corpus_metric_names
    from vembed.evaluation.pairs import retrieval_metric_names

    data = recipe.data
    if data.validation is None:
        return []
    corpora = corpus_sources(data, "validation")
    pairs, corpus = retrieval_metric_names(recipe.loss.mrl_dims) + _scored_metric_names(recipe), corpus_metric_names()
    if not isinstance(data.validation, dict):
        return corpus if None in corpora else pairs
    per_source = {name: corpus if name in corpora else pairs for name in data.validation}
    shared = [key for key in pairs + corpus if all(key in keys for keys in per_source.values())]
    return shared + [f"{name}/{key}" for name, keys in per_source.items() for key in keys]


def _scored_metric_names(recipe: "Recipe") -> list[str]:
    """Similarity metrics where the loss trains on gold scores, triplet accuracy where on hard negatives: what a
    validation split of the same shape as the training data gives (vembed/evaluation/scored.py)."""
    from vembed.components import loss_class
    from vembed.evaluation.scored import SIMILARITY_METRICS, TRIPLET_METRICS

    loss = loss_class(recipe)
    names = list(SIMILARITY_METRICS) if getattr(loss, "needs_scores", None) == "pair" else []
    return names + (list(TRIPLET_METRICS) if getattr(loss, "min_negatives", 0) >= 1 else [])


def _resolve_best_metric(recipe: "Recipe", check: bool = False) -> None:
    """metric_for_best_model must be a validation metric. Left unset, it is q2d/accuracy@1, or corpus/ndcg@10 where
    the validation split is all corpus folders (the metric BEIR and MTEB rank by). An old name (`q2d/recall@1`, the
    hit rate before issue 23) is read as the new one, with a warning. `check`: a name that is not among the
    validation metrics is a RecipeError listing them (before anything is built)."""
    from vembed.evaluation.pairs import renamed_metric

    new_name = renamed_metric(recipe.metric_for_best_model)
    if new_name is not None:
        logger.warning("metric_for_best_model: %s is now named %s (the share of queries with a relevant document in "
                       "the top k, as sentence-transformers names it); using %s", recipe.metric_for_best_model,
                       new_name, new_name)
        recipe.metric_for_best_model = new_name
    names = validation_metric_names(recipe)
    if not names or recipe.metric_for_best_model in names:
        return
    if "metric_for_best_model" not in recipe.model_fields_set and "corpus/ndcg@10" in names:
        recipe.metric_for_best_model = "corpus/ndcg@10"
        recipe.model_fields_set.discard("metric_for_best_model")  # still the default, only resolved
        return
    if check:
        raise RecipeError("metric_for_best_model", f"{recipe.metric_for_best_model!r} is not a validation metric of "
                                                   f"this recipe{did_you_mean(recipe.metric_for_best_model, names)}; "
                                                   f"use one of: {', '.join(names)}")


def _check_teacher_embeddings(recipe: "Recipe", dim: int, streamed: bool) -> None:
    """embedding_mse's teacher folder, from its index only (no vector is read): it exists, and its vectors have the
    student's size; what cannot be matched to rows (streamed data) or to a truncated embedding (Matryoshka) is
    refused. The rows themselves are matched when the training data is loaded (`TeacherEmbeddings.check_rows`)."""
    from vembed.data.teacher_embeddings import KEY, read_index

    if streamed:
        raise RecipeError(KEY, "teacher embeddings are matched to the rows of files read whole; set "
                               "data.streaming: false")
    if recipe.loss.mrl_dims:
        raise RecipeError("mrl_dims", f"{recipe.loss_type} regresses the whole embedding onto the teacher's; "
                                      "remove mrl_dims")
    teacher_dim = read_index(recipe.loss.teacher_embeddings).get("dim")
    if teacher_dim != dim:
        raise RecipeError(KEY, f"the teacher's embeddings in {recipe.loss.teacher_embeddings!r} have {teacher_dim} "
                               f"dims, this student's {dim}: give a student of the teacher's size (a projection "
                               "between the two is not built)")


def _check_token_vectors(recipe: "Recipe") -> None:
    """Token vectors (`embedding: multi_vector`) go with a loss that scores them (late_interaction...), one vector per
    side with the others; they are evaluated on corpus folders (MaxSim search, vembed/retrieval/maxsim_search.py),
    not on pair files, whose metrics score one vector per side."""
    from vembed.components import loss_class
    from vembed.losses import LOSSES

    multi = getattr(recipe.model, "embedding", "single") == "multi_vector"
    if multi != loss_class(recipe).token_vectors:
        if multi:
            scoring = ", ".join(name for name in LOSSES.names() if LOSSES.get(name).token_vectors)
            raise RecipeError("loss_type", f"{recipe.loss_type} scores one vector per side; embedding: multi_vector "
                                           f"gives token vectors: use a loss_type that scores them ({scoring})")
        raise RecipeError("loss_type", f"{recipe.loss_type} scores token vectors; set embedding: multi_vector "
                                       "(model_type text or qwen_vl) or choose another loss_type")
    key = _held_out_pair_files(recipe) if multi else None
    if key is not None:
        raise RecipeError(key, "pair files are evaluated one vector per side; a multi_vector model is evaluated on a "
                               "corpus folder (corpus.jsonl, queries.jsonl, qrels/): give one, or remove the split")


def _held_out_pair_files(recipe: "Recipe") -> str | None:
    """The key of the first held-out split (or source) that is a pair file, not a corpus folder; None if none."""
    from vembed.data.corpus import corpus_sources

    for split in ("validation", "test"):
        sources = recipe.data.sources(split)
        parts = [None] if sources is None else list(sources)
        pairs = [name for name in parts if name not in corpus_sources(recipe.data, split)]
        if getattr(recipe.data, split) is not None and pairs:
            return f"data.{split}" if pairs == [None] else f"data.{split}.{pairs[0]}"
    return None


def document_texts(rows: Iterable[Example]) -> Iterator[str]:
    """The texts of the training documents (positives and hard negatives) of `rows`: what IDF is counted over."""
    for example in rows:
        for side in (example.positive, *example.negatives):
            if side.text:
                yield side.text


def _check_sparse(recipe: "Recipe") -> None:
    """FLOPS regularisation goes with sparse vectors (`embedding: sparse`), and a sparse model with neither Matryoshka
    (prefixes of a vocabulary-sized vector, L2-normalised, mean nothing) nor pair files to evaluate on, whose metrics
    are cosines; corpus folders are searched by dot product (`vembed.retrieval.search`'s sparse Scoring)."""
    sparse = getattr(recipe.model, "embedding", "single") == "sparse"
    if not sparse:
        for key in ("flops_query_weight", "flops_document_weight"):
            if getattr(recipe.loss, key) is not None:
                raise RecipeError(key, "FLOPS regularises sparse vectors; set embedding: sparse (model_type text) or "
                                       "remove it")
        return
    init = getattr(recipe.model, "static_query_init", IDF)
    if getattr(recipe.model, "static_query", False) and init not in (IDF, "ones") and not Path(init).is_file():
        raise RecipeError("static_query_init", f"is neither idf, ones nor a file: no {init!r}; give the path of a "
                                               "JSON object token -> weight (sentence-transformers' idf.json)")
    if recipe.loss.mrl_dims:
        raise RecipeError("mrl_dims", "Matryoshka truncates and L2-normalises dense vectors; a sparse vector's "
                                      "dimensions are the vocabulary: remove mrl_dims")
    key = _held_out_pair_files(recipe)
    if key is not None:
        raise RecipeError(key, "pair files are evaluated by cosine; a sparse model is scored by dot product, on a "
                               "corpus folder (corpus.jsonl, queries.jsonl, qrels/): give one, or remove the split")


def _check_source_and_stage_keys(recipe: "Recipe", adapter_cls: type) -> None:
    """Keys a model cannot honour are refused before training, naming them: a per-source instruction for a model
    without instructions, a stage image size for a model with a fixed one."""
    from vembed.models.base import EmbeddingAdapter

    for split in ("train", "validation", "test"):
        for name, source in (recipe.data.sources(split) or {}).items():
            if source.query_instruction is not None and not hasattr(adapter_cls, "instruction_for"):
                raise RecipeError(f"data.{split}.{name}.query_instruction",
                                  f"model_type {recipe.model_type} takes no instruction; use query_prompt (text put "
                                  "before each query) instead")
    fixed = adapter_cls.set_pixel_budget is EmbeddingAdapter.set_pixel_budget
    for number, stage in enumerate(recipe.stages or ()):
        for key in ("min_pixels", "max_pixels"):
            if getattr(stage, key) is not None and fixed:
                raise RecipeError(f"stages.{number}.{key}", f"model_type {recipe.model_type} has a fixed image size; "
                                                             "only qwen_vl changes it per stage")


def check_images_per_side(model_type: str, examples: "Sequence[Example]") -> None:
    """Refuse, before training, records with more images on one side than the model embeds (naming the row)."""
    from vembed.data.rows import PairRows
    from vembed.models import MODELS

    limit = MODELS.get(model_type).max_images_per_side
    if limit is None:
        return
    if isinstance(examples, PairRows) or hasattr(examples, "most_images_per_side"):  # PairRows, CorpusPairs: from
        # the row checks (the corpus): only the record with the most images is made ...
        most, where = examples.most_images_per_side()
        if most <= limit:
            return
        _check_images(model_type, limit, [examples[where]])
    _check_images(model_type, limit, examples)  # ... unless its extra images were negatives it does not keep


def _check_images(model_type: str, limit: int, examples: "Sequence[Example]") -> None:
    for example in examples:
        named = [("the query", example.query), ("the positive", example.positive)]
        named += [("a hard negative", negative) for negative in example.negatives]
        for name, side in named:
            if len(side.images) > limit:
                raise DataError(
                    f"{name} has {len(side.images)} images; model_type {model_type} embeds at most {limit} per side "
                    "(qwen_vl takes several): give one image path per cell",
                    file=example.source,
                    row=example.row,
                )


def side_images(data: "EvalData | None") -> list[Any]:
    """The images of a list of records (query, positive, negatives) or of a corpus split (documents and queries)."""
    if not data:
        return []
    if hasattr(data, "corpus"):
        sides = [*data.corpus.sides, *data.queries.sides]
    else:
        sides = [side for example in data for side in (example.query, example.positive, *example.negatives)]
    return [image for side in sides for image in side.images]
