"""Every rule a recipe must pass, in the order the rules run: all of them before any weight is read.

"What makes a recipe valid, and where is rule X" is answered here. Rules that need only the recipe are the schema's
or this module's; a rule owned by a component (a task, an adapter, a loss, a data reader) stays beside that component
and is called from here, in this order. Each stops the run with one `RecipeError` naming the key (exit 2);
tests/test_recipe_checks.py fails when a recipe error is raised anywhere else.

1. Schema (`vembed/recipe.py`, when the recipe is loaded): keys, types and ranges; the combinations of the recipe's
   own keys (`Recipe._cross_checks`, `DataConfig._source_checks`, `StageConfig._weights`); `model_type` and
   `loss_type` name registered components (`vembed/components.py`), whose `Settings` classes type and check their
   own keys (e.g. mrl_dims in `vembed/losses/base.py`, token-vector keys in `vembed/models/text.py`).
2. Components (`check_components`): the model and the loss train the same task (`vembed.tasks.task_name_for`, the
   rule every caller of `task_for` needs).
3. The recipe's own keys that need more than the schema (`check_keys`): data.train is set for training; every
   tracker of report_to is installed, and scipy where document_pool_factor pools token vectors
   (`vembed.retrieval.maxsim_search.require_token_pooling`) or where sparse vectors are evaluated on held-out data
   (their inverted index: `vembed.retrieval.sparse_index.require_scipy`); `augmentation:` only where the task reads it
   (`check_augmentation`);
   use_gradient_cache only where the task has a batch-wide loss (`Task.check_gradient_cache`, the rule
   `vembed plan` applies too).
4. The task's rules (`Task.check_recipe` of the registered task), which call the data's and the adapter's:
   - contrastive (`vembed/tasks/contrastive.py`): data.format; what streamed data cannot do, and its shards
     (`vembed.data.streaming.check_stream_recipe`); the data files exist (`vembed.data.paths.check_data_paths`);
     the adapter's own rules (`check_recipe` of its class in `vembed/models/`: model_name or model_config, a
     tokenizer for a random-init text tower, ...); per-source instructions and stage image sizes the adapter can
     honour; token vectors and the loss agree; FLOPS keys, Matryoshka and in-run evaluation fit sparse vectors (a
     masked-LM head for them: `vembed/models/splade.py`); the GISTEmbed guide folder holds a model
     (`vembed/losses/guide.py`); metric_for_best_model is a validation metric; mrl_dims fit the embedding size the
     model's config declares.
   - classification (`vembed/classification/task.py`): one file or ImageFolder per split, no streaming, GradCache or
     stages; a classification metric; the adapter's own rules (`check_recipe` in `vembed/models/vision.py`: a backbone
     it drives, a CLIP/SigLIP text tower for head_init: class_names, no pooling or projection_dim over a dual encoder);
     the classes of the data (`vembed/classification/labelled.py`, which reads the labelled files here) fit num_labels.
   - metric_learning (`vembed/classification/metric_task.py`): the labelled files of classification, no head
     (num_labels, head_init), no streaming, GradCache or stages; a retrieval metric (MAP@R, recall@k);
     pytorch-metric-learning, which computes its losses, is installed (`vembed/classification/metric_losses.py`); every
     class has a second image where the loss needs positives; ArcFace's num_classes fits the data.
   - rerank (`vembed/reranking/task.py`): no GradCache or streaming; the data files exist; held-out data
     (validation, test) is a corpus folder with its first-stage run (`data.first_stage_run`); a reranking metric;
     the cross-encoder's own rules (`vembed/reranking/cross_encoder.py`).
   - flow_matching (`vembed/generation/task.py`): shard directories only and the keys blip3o_dit cannot honour; a
     flow-matching metric; the shards' dims fit the recipe's (`vembed/generation/dit.py`).
   Then, for every task, layer_lr_decay needs parameter names that say their block (`check_layer_lr_decay`, on the
   meta-device build).
5. The output folder (`vembed.training.run_dir.check_output_dir`, called by the launcher before any process
   starts and by the trainer before anything is written): writable, not another run's, resume_from and
   overwrite_output_dir not both set.
6. The launch (`check_launch`: by run.py / `vembed train` from the accelerate config before any process starts,
   `vembed.entrypoints.launch.check_planned_launch`; and by `vembed.training.launch_plan.decide_launch` in each
   training process once the launch's environment says its kind, before a data row is read): fp16 needs a GPU; FSDP
   needs an adapter naming block classes (`check_fsdp_blocks`, on the meta-device build); use_fsdp needs an FSDP
   launch; GradCache only where the task and the launch allow it (`vembed.planning.choose_gradient_cache`, the one
   GradCache rule); compile only where it is verified.

Rules that need the rows themselves run as the data is read (`Task.load_train_data`: images per side, the inputs a
loss needs, a label per record for a loss that mines on labels; `Task.load_held_out`: every held-out image decodes),
still before any weight is read or the output folder is taken; they are data errors, naming file and row.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from vembed.errors import EnvironmentProblem, RecipeError

if TYPE_CHECKING:
    from vembed.planning import GradientCacheChoice, LaunchKind
    from vembed.recipe import Recipe
    from vembed.tasks import Task
    from vembed.training.launch_promise import LaunchPromise


def check_recipe(recipe: "Recipe", *, for_training: bool = True) -> None:
    """Stages 2 to 4 (stage 1 ran when the recipe was loaded; 5 and 6 need the output folder and the launch): every
    check that needs more than the schema, before any model is built."""
    task = check_components(recipe)
    check_keys(recipe, for_training=for_training)
    check_augmentation(recipe, task)
    check_class_balance(recipe, task)
    check_packing(recipe)
    task.check_gradient_cache(recipe)
    task.check_recipe(recipe, for_training=for_training)  # data files, model config, task-specific keys
    if for_training and recipe.layer_lr_decay is not None:
        from vembed.planning import meta_model

        check_layer_lr_decay(recipe, meta_model(recipe))  # stage 4, continued: the model's parameter names


def check_components(recipe: "Recipe") -> type["Task"]:
    """Stage 2: the task the model and the loss both train (a RecipeError when they differ)."""
    from vembed.tasks import task_for

    return task_for(recipe)


def check_keys(recipe: "Recipe", *, for_training: bool = True) -> None:
    """Stage 3: the recipe's own keys that the schema cannot judge alone."""
    if for_training and recipe.data.train is None:
        raise RecipeError("data.train", "is required for training; point it at a JSONL/CSV/Parquet file or directory")
    # accelerate drops a tracker whose package is missing with only a log line; a user asked for it, so refuse.
    for tracker in recipe.report_to:
        if importlib.util.find_spec(tracker) is None:
            raise EnvironmentProblem("report_to", f"{tracker} is not installed; pip install 'vembed[{tracker}]' or "
                                                  "remove it")
    pool_factor = getattr(recipe.model, "document_pool_factor", 1)
    if pool_factor > 1:  # corpus evaluation pools each document's token vectors, and so does every later search
        from vembed.retrieval.maxsim_search import require_token_pooling

        require_token_pooling(pool_factor, "document_pool_factor")
    if getattr(recipe.model, "embedding", None) == "sparse" and recipe.data.validation is not None:
        from vembed.retrieval.sparse_index import require_scipy  # in-run evaluation searches its inverted index

        require_scipy("embedding")


def check_packing(recipe: "Recipe") -> None:
    """Stage 3, continued: `packing` where the model kind packs its texts (`packs_texts`) and its architecture calls
    transformers' attention interface (vembed/models/packing.py), without the keys it replaces."""
    settings = recipe.model
    if not getattr(settings, "packing", False):
        return
    from vembed.components import model_class

    adapter_cls = model_class(recipe)
    if not getattr(adapter_cls, "packs_texts", False):
        raise RecipeError("packing", f"model_type {recipe.model_type!r} cannot pack its inputs; remove packing (text "
                                     "models and cross-encoders pack)")
    if settings.attn_implementation is not None:
        raise RecipeError("attn_implementation", "packing runs its own attention (varlen flash attention on CUDA); "
                                                 "remove attn_implementation or packing")
    if recipe.length_chunks > 1:
        raise RecipeError("length_chunks", "packed texts have no padding to cut into length-sorted chunks; remove "
                                           "length_chunks or packing")
    from transformers import AutoModel

    from vembed.models.packing import inline_attention_reason, packs_attention

    config = adapter_cls.hf_config(settings)  # the config only, no weights
    architecture = AutoModel._model_mapping.get(type(config), None)
    if architecture is not None and not packs_attention(architecture):
        raise RecipeError("packing", inline_attention_reason(architecture.__name__))


def check_augmentation(recipe: "Recipe", task: type["Task"]) -> None:
    """Stage 3, continued: `augmentation:` is read by the tasks that say so (`Task.augments_images`), nowhere else."""
    from vembed.tasks import TASKS

    if recipe.augmentation.enabled and not task.augments_images:
        readers = [name for name in TASKS.names() if TASKS.get(name).augments_images]
        raise RecipeError("augmentation", f"is read by the {' and '.join(readers)} task{'s' * (len(readers) > 1)} "
                                          f"only, but this recipe trains {task.name}; remove it")


def check_class_balance(recipe: "Recipe", task: type["Task"]) -> None:
    """Stage 3, continued: `data.m_per_class` is for the tasks whose records have a class
    (`Task.class_balanced_batches`), and a batch holds whole classes."""
    from vembed.tasks import TASKS

    m = recipe.data.m_per_class
    if m is None:
        return
    if not task.class_balanced_batches:
        readers = [name for name in TASKS.names() if TASKS.get(name).class_balanced_batches]
        raise RecipeError("data.m_per_class", f"balances batches of labelled images ({' and '.join(readers)}), but "
                                              f"this recipe trains {task.name}; remove it")
    if recipe.batch_size % m:
        raise RecipeError("data.m_per_class", f"{m} images of a class per batch need a batch_size that is a "
                                              f"multiple of {m} (each process's batch holds whole classes); "
                                              f"batch_size is {recipe.batch_size}")


def check_launch(recipe: "Recipe", kind: "LaunchKind", *, on_cpu: bool,
                 promise: "LaunchPromise") -> "GradientCacheChoice":
    """Stage 6: what the recipe asks of this launch (`kind`, on CPU or not, what the launcher promised), before a data
    row or a weight is read; returns the GradCache choice its rule made. Refusals of the launch itself (a promise
    broken, a DeepSpeed or FSDP config vembed cannot run) are launch errors, in vembed/training/launch_plan.py."""
    from vembed.planning import choose_gradient_cache, meta_model

    if on_cpu and recipe.mixed_precision == "fp16":
        raise RecipeError("mixed_precision", "fp16 needs a GPU; use bf16 or no on CPU")
    if recipe.ema_decay is not None and kind in ("fsdp", "deepspeed"):
        raise RecipeError("ema_decay", f"keeps a whole copy of the trained weights on every process, but this {kind} "
                                       "launch shards them; launch single-process or DDP, or remove ema_decay")
    if kind == "fsdp":
        check_fsdp_blocks(recipe, meta_model(recipe))
    if recipe.use_fsdp and kind != "fsdp":
        raise RecipeError("use_fsdp", f"is true but this launch is not FSDP; {_fsdp_hint(promise)}")
    grad_cache = choose_gradient_cache(recipe, kind)
    if recipe.compile:
        _check_compile(recipe, kind, on_cpu)
    return grad_cache


def check_layer_lr_decay(recipe: "Recipe", model: Any) -> None:
    """`layer_lr_decay` needs parameter names that say their block (vembed/models/depths.py reads them); checked on
    the meta model (no weight read) with the rest of the recipe, before the launch. A model that cannot be built there
    meets the same rule when its optimizer is built."""
    from vembed.models.depths import layer_depths

    if model is None:
        return
    _, top = layer_depths([name for name, _ in model.named_parameters()])
    if top == 1:
        raise RecipeError("layer_lr_decay", f"no parameter name of model_type {recipe.model_type!r} says which layer "
                                            "it is in (as 'layers.3.' does); remove layer_lr_decay for this model")


def _check_compile(recipe: "Recipe", kind: "LaunchKind", on_cpu: bool) -> None:
    """`compile: true` where it is known to train as the eager model does (tests/training/test_compile.py: one
    process, GradCache and LoRA, to 1e-5; test_ddp_step.py: 2 DDP ranks as one process); one line naming the key
    and the reason everywhere else."""
    import shutil

    from vembed.components import model_class
    from vembed.models.base import EmbeddingAdapter

    if kind in ("fsdp", "deepspeed"):
        raise RecipeError("compile", f"is not available under {'FSDP' if kind == 'fsdp' else 'DeepSpeed'}: their "
                                     "hooks gather and free each tower's weights around its forward, which compiled "
                                     "towers are not verified against; use DDP, or compile: false")
    if not issubclass(model_class(recipe), EmbeddingAdapter):
        raise RecipeError("compile", f"model_type {recipe.model_type} names no encoder towers to compile")
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise RecipeError("compile", "torch.compile does not support this Python/torch build; use compile: false")
    compiler = os.environ.get("CXX", "g++")
    if on_cpu and shutil.which(compiler) is None:
        raise RecipeError("compile", f"torch.compile on CPU builds C++ kernels, and no C++ compiler ({compiler}) is "
                                     "installed; install one (e.g. apt-get install g++) or use compile: false")


def _fsdp_hint(promise: "LaunchPromise") -> str:
    if promise.command in ("python run.py", "vembed train"):
        return f"launch with `{promise.command} RECIPE` on several GPUs, or add --accelerate_config fsdp"
    return f"launch with {promise.use_config_hint('fsdp')}"


def check_fsdp_blocks(recipe: "Recipe", model: Any) -> None:
    """FSDP shards the blocks the adapter names; refuse a model that names none. Stage 6 judges the meta-device build;
    an adapter that cannot be built there (`model` None) is judged by this same rule when FSDP shards the real one."""
    if model is None or model.block_classes():
        return
    raise RecipeError(
        "model_type",
        f"the {recipe.model_type} adapter names no transformer block class to shard with FSDP; use DDP "
        "(accelerate_configs/ddp.yaml) or DeepSpeed ZeRO-3",
    )


__all__ = ["check_components", "check_fsdp_blocks", "check_keys", "check_launch", "check_recipe"]
