"""The memory planner behind `vembed plan`: per-device memory of a recipe under each launch strategy, and a choice.

"Plan" means four things in vembed; this is the memory plan (`MemoryPlan`). The others: the launch plan
(training/launch_plan.py, `LaunchPlan`: how this launch is distributed, decided once), a stage's length
(training/stages.py, `Stage.plan`) and a streamed epoch's batches by the shard index (data/streaming.py).

Everything is estimated from configs: the adapter is built on the meta device (`EmbeddingAdapter.on_meta`, no
weights read), so parameter counts are exact, and LoRA counts are exact too because the same `apply_lora` that
training uses runs on the meta model. Bytes per device, for Ψ parameters of which Ψt are trainable, N devices:

| strategy        | parameters                        | gradients              | optimizer (AdamW)                  |
| single          | 4Ψ (+2Ψt autocast cache under mp) | 4Ψt                    | 8Ψt (two fp32 moments)             |
| DDP (+GradCache)| as single                         | 8Ψt (grads + buckets)  | 8Ψt                                |
| FSDP FULL_SHARD | 4Ψ/N + 2 gathered layers          | 4Ψt/N                  | 8Ψt/N                              |
| ... CPU offload | 2 gathered layers                 | 0 (on CPU)             | 0 (on CPU)                         |
| ZeRO-2          | 2Ψ under mp (4Ψ without)          | 4Ψt/N                  | 8Ψt/N (+4Ψt/N fp32 master under mp)|
| ZeRO-3          | 2Ψ/N (4Ψ/N) + 2 gathered layers   | 4Ψt/N                  | as ZeRO-2                          |

vembed keeps fp32 weights and gets mixed precision from autocast, so single/DDP/FSDP need no separate master copy;
DeepSpeed keeps the module in 16 bits and the fp32 master in its optimizer. DDP's gradient buckets are a second copy
of the gradients (`gradient_as_bucket_view` is off by default).

Activations, per transformer layer and sample of s tokens (hidden h, intermediate i, a heads), with e bytes per
element (4 fp32, 2 under bf16/fp16 autocast): `s·(8e·h + m·e·i)`, with m = 2 intermediate-width tensors for a plain
MLP (3 for quick_gelu, 4 for gated MLPs). This is Korthikanti et al. (2022)'s `s·h·(34 + 5·a·s/h)` (16-bit, i = 4h)
generalised to any e and i, with the dropout masks and s×s attention matrices counted by what the kernels really
keep (`Kernels`): on CUDA, fused SDPA keeps no s×s matrix and masks are 1 byte; on CPU (measured) masks are e bytes,
attention dropout sends SDPA down its math path (3 s×s matrices per head) and a padding mask is kept per layer;
`attn_implementation: eager` keeps the probabilities everywhere. Plus 2e·s·h per encoder (embedding norm input, final
hidden state). With gradient checkpointing only each layer's input (e·s·h) is kept, plus one layer's full set during
its recomputation. GradCache holds the activations of one chunk (`gradient_cache_chunk_size` examples, all their
sides) plus fp32 embeddings and their gradients for the whole gathered contrastive batch. The loss adds three fp32
(C × C·(1+k)) matrices (logits, softmax, gradient; twice when symmetric) for a contrastive batch C with k hard
negatives. Queries are embedded by the text encoder and documents by the image encoder when the adapter has one;
an adapter can route sides otherwise (`EmbeddingAdapter.planning_tokens`): Qwen-VL passes every side through its
language model and a document's image also through the vision tower, with sequence lengths from max_pixels.
Models that are not transformer encoders with an HF config (the BLIP3-o DiT: one pass per sample, its own
flow-matching loss) count what autograd keeps themselves (`CountedShape`): fp32 and 16-bit elements per sample, since
under autocast their residual stream and norms stay fp32; LoRA and GradCache strategies are left out for them when
they train without (`ModelSize.lora`, `.gradient_cache`), and there is no contrastive loss matrix.
A cross-encoder reranker routes one role, `pair`: an example is a list of 1 + data.num_hard_negatives (query,
document) pairs, each read jointly by its one encoder at max_length tokens; it has no embeddings, no batch-wide loss
and no GradCache, and with `pairs_per_chunk` only one chunk's activations are counted (each chunk is checkpointed).

The total (a steady-state step's peak) is parameters + optimizer state + persistent gradient buffers (DDP buckets,
DeepSpeed partitions) + max(activations, gradients): gradients are freed by zero_grad(set_to_none=True) and, during
backward, appear layer by layer as that layer's activations are freed, so the peak is at the start of backward (all
activations) or its end (all gradients).

Measured error of the total against the peak resident memory of two real training steps (bench/planner_accuracy.py,
CPU, fp32, one process; table in docs/benchmarks.md): without gradient checkpointing -4% to -1% for 22.7M and 109M
text encoders; with it -13% to +34% (the live set while a checkpointed layer is recomputed is the least certain term);
-19% for a 4 MiB tiny CLIP, where ~25 MiB of fixed runtime memory (autograd engine, oneDNN caches) dominates.
Parameter counts are exact; parameter and optimizer bytes are within 3% (plus that fixed runtime memory). On GPUs the
CUDA context and allocator slack are covered by the reserve (USABLE_FRACTION, CUDA_CONTEXT_GIB), not measured here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vembed.models.base import EmbeddingAdapter
    from vembed.recipe import Recipe


# --- GradCache on or off: the one rule the run (launch_plan) and `vembed plan` both follow ----------------------------

LaunchKind = Literal["single", "ddp", "fsdp", "deepspeed"]

AUTO_GRADIENT_CACHE_PARAMETERS = 1_000_000_000  # the seeds' rule: checkpointing on a >1B model turns GradCache on
DEFAULT_GRADIENT_CACHE_CHUNK = 8


@dataclass(frozen=True)
class GradientCacheChoice:
    enabled: bool
    chunk_size: int | None  # samples per forward chunk, when enabled
    reason: str  # why, for the start block


def meta_model(recipe: "Recipe"):
    """This recipe's model on the meta device (shapes only, no weights read), or None when the adapter cannot be
    built there; the decisions that need it are then made when the real model exists."""
    from vembed.components import model_class

    try:
        return model_class(recipe).on_meta(recipe)
    except NotImplementedError:
        return None


def choose_gradient_cache(recipe: "Recipe", kind: LaunchKind,
                          num_parameters: int | None = None) -> GradientCacheChoice:
    """GradCache on or off for this launch, why, and its chunk size (never more than the per-device batch).

    Asked for under FSDP or DeepSpeed it is refused; the automatic rule (gradient checkpointing on a model of more
    than 1B parameters) does not switch it on there, so a big-model FSDP recipe runs without it. `num_parameters`:
    the model's size; unset, it is counted on the meta device only when the rule needs it.
    """
    from vembed.tasks import task_for

    task = task_for(recipe)
    if not task.uses_gradient_cache:  # no batch-wide loss (rerank: no in-batch negatives; classification)
        task.check_gradient_cache(recipe)
        return GradientCacheChoice(False, None, "off")
    unavailable = {
        "fsdp": "GradCache is not available under FSDP: its cached loss runs outside the sharded forward, where the "
                "loss's own parameters stay sharded; use DDP + GradCache (with LoRA for big models) or FSDP without it",
        "deepspeed": "GradCache needs several backward passes per optimizer step, which DeepSpeed's engine counts "
                     "as separate micro-steps; use DDP + GradCache, or DeepSpeed without it",
    }.get(kind)
    if unavailable is None:
        unavailable = _loss_refuses_gradient_cache(recipe)
    if recipe.use_gradient_cache:
        if unavailable:
            raise RecipeError("use_gradient_cache", unavailable + " (use_gradient_cache: false)")
        return GradientCacheChoice(True, _chunk(recipe), "on (use_gradient_cache)")
    if recipe.use_gradient_cache is False or not recipe.gradient_checkpointing:
        return GradientCacheChoice(False, None, "off")
    if unavailable:
        where = {"fsdp": "under FSDP", "deepspeed": "under DeepSpeed"}.get(kind, f"with loss_type {recipe.loss_type}")
        return GradientCacheChoice(False, None, f"off (not available {where}; the >1B + checkpointing rule does not "
                                                "apply)")
    if num_parameters is None:
        model = meta_model(recipe)
        num_parameters = sum(p.numel() for p in model.parameters()) if model is not None else 0
    if num_parameters <= AUTO_GRADIENT_CACHE_PARAMETERS:
        return GradientCacheChoice(False, None, "off")
    return GradientCacheChoice(True, _chunk(recipe), f"on (automatic: gradient_checkpointing with "
                                                     f"{num_parameters / 1e9:.1f}B parameters; set use_gradient_cache: "
                                                     "false to turn it off)")


def _loss_refuses_gradient_cache(recipe: "Recipe") -> str | None:
    """The loss's own reason it cannot run under GradCache (`EmbeddingLoss.gradient_cache_refusal`), or None."""
    from vembed.components import loss_class

    refusal = getattr(loss_class(recipe), "gradient_cache_refusal", None)
    return None if refusal is None else f"loss_type {recipe.loss_type} cannot run under GradCache: {refusal}"


def _chunk(recipe: "Recipe") -> int:
    return min(recipe.gradient_cache_chunk_size or DEFAULT_GRADIENT_CACHE_CHUNK, recipe.batch_size)


GIB = 1024**3
FP32 = 4
# Not every byte of a GPU is usable: the CUDA context and cuBLAS workspaces take ~0.5 GiB, and the caching allocator
# fragments. A plan "fits" when its total is at most this share of the memory, less the context.
USABLE_FRACTION = 0.9
CUDA_CONTEXT_GIB = 0.5
GATHERED_LAYERS = 2  # FSDP/ZeRO-3 hold the layer being computed plus the one being prefetched, unsharded


# Under 16-bit autocast a layer keeps 8 more bytes per token and hidden unit than the e = 2 formula: its two LayerNorm
# inputs stay fp32 (2 x 2 bytes more), and two of its Linear inputs are 16-bit cast copies where an fp32 run saves a
# tensor it already keeps (2 x 2 bytes). Measured with saved-tensor hooks on BERT under CPU bf16 autocast
# (tests/test_planning.py); without it the planner was 0.78x the measured peak on an H200 (docs/benchmarks.md).
AUTOCAST_EXTRA_BYTES = 8


# --- what the model and the batch look like ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Kernels:
    """What a device's kernels keep for backward beyond the tensors every implementation keeps. CPU figures are
    measured (saved-tensor hooks on BERT layers, torch 2.13; tests/test_planning.py checks them); CUDA figures follow
    the kernels' design: flash / memory-efficient SDPA keep no s×s matrix and draw dropout inside the kernel, and
    dropout masks are bool."""

    name: str
    dropout_mask_bytes: int | None  # per element of a dropout mask; None: the activation width (CPU keeps float masks)
    sdpa_dropout_matrices: int  # s×s matrices per head SDPA keeps under attention dropout (CPU: math path, 3)
    sdpa_mask_copy: bool  # SDPA keeps a per-layer s×s copy of the padding mask at activation width (CPU)


KERNELS = {"cuda": Kernels("cuda", 1, 0, False), "cpu": Kernels("cpu", None, 3, True)}
# `packing: true` (vembed/models/packing.py): no padding mask and no attention-probability dropout, so no s×s tensor
# on either device (varlen flash on CUDA; on CPU each text alone through SDPA's fused kernel). Its s is a text's real
# length: the planner's max_length is the worst case, `tokens_per_role` gives the data's.
PACKED_KERNELS = {"cuda": Kernels("cuda, packed", 1, 0, False), "cpu": Kernels("cpu, packed", None, 0, False)}


# MLPs with a gate (act(gate(x)) * up(x)) keep four intermediate-width tensors for backward instead of two.
GATED_MLP_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen3_vl", "gemma", "gemma2",
                                   "gemma3_text", "phi3", "modernbert",
                                   # Qwen-VL language models, and Qwen2.5-VL's vision blocks (Qwen2-VL's and
                                   # Qwen3-VL's vision MLPs are plain: quick_gelu / gelu_pytorch_tanh)
                                   "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen2_5_vl_vision"})

# Config attribute names of the same quantity across architectures, first found wins: Qwen-VL vision towers say
# depth / num_heads, and Qwen2-VL's says embed_dim for its own width (its hidden_size is the language model's).
LAYERS_NAMES = ("num_hidden_layers", "depth")
HIDDEN_NAMES = ("embed_dim", "hidden_size")
HEADS_NAMES = ("num_attention_heads", "num_heads")


def _first(config: "PretrainedConfig", names: tuple[str, ...]) -> int | None:
    return next((value for name in names if (value := getattr(config, name, None))), None)


def _mlp_tensors(config: "PretrainedConfig") -> int:
    """Intermediate-width tensors an MLP keeps: its activation's input and output (a fused GELU/ReLU/SiLU), one more
    for quick_gelu (x·sigmoid(1.702x) is two ops, measured on CLIP), two more for a gated MLP."""
    if config.model_type in GATED_MLP_MODEL_TYPES:
        return 4
    return 3 if getattr(config, "hidden_act", None) == "quick_gelu" else 2


def _dropout(config: "PretrainedConfig", names: tuple[str, ...]) -> bool:
    return any((getattr(config, name, 0) or 0) > 0 for name in names)


@dataclass(frozen=True)
class EncoderShape:
    """The transformer embedding one modality: what activation memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    tokens: int  # per sample: max_length for text, patches (+1 class token) for images
    masked: bool = False  # takes an attention (padding) mask: text
    mlp_tensors: int = 2  # intermediate-width tensors the MLP keeps (see _mlp_tensors)
    hidden_dropout: bool = False
    attention_dropout: bool = False

    @classmethod
    def from_config(
        cls, config: "PretrainedConfig", modality: str, max_length: int | None, tokens: int | None = None
    ) -> "EncoderShape":
        """`tokens` per sample when the adapter knows them (`EmbeddingAdapter.planning_tokens`); otherwise
        max_length for text and patches (+1 class token) of `image_size` for images."""
        hidden = _first(config, HIDDEN_NAMES)
        layers = _first(config, LAYERS_NAMES)
        if not hidden or not layers:
            raise RecipeError(
                "model_config",
                f"the {modality} encoder ({config.model_type}) is not a plain transformer (no hidden_size / "
                "num_hidden_layers); the planner cannot estimate its activations",
            )
        if tokens is not None:
            pass
        elif modality == "image":
            if not getattr(config, "image_size", None):
                raise RecipeError("model_config", f"the image encoder ({config.model_type}) has no fixed image_size; "
                                  "its adapter must give the planner its tokens (planning_tokens)")
            patches = (config.image_size // config.patch_size) ** 2
            tokens = patches + 1  # a class token (CLIP, ViT, DINOv2); SigLIP has none: one token too many, on purpose
        else:
            tokens = max_length or getattr(config, "max_position_embeddings", None) or 512
        mlp_ratio = getattr(config, "mlp_ratio", None) or 4
        return cls(
            layers=layers,
            hidden=hidden,
            intermediate=getattr(config, "intermediate_size", None) or int(mlp_ratio * hidden),
            heads=_first(config, HEADS_NAMES) or 1,
            tokens=tokens,
            masked=modality == "text",
            mlp_tensors=_mlp_tensors(config),
            hidden_dropout=_dropout(config, ("hidden_dropout_prob", "hidden_dropout", "dropout")),
            attention_dropout=_dropout(config, ("attention_probs_dropout_prob", "attention_dropout")),
        )

    def _attention_matrix_bytes(self, element: int, kernels: Kernels, eager: bool) -> int:
        """Bytes per sample of the s×s attention matrices one layer keeps (none for fused SDPA kernels)."""
        s, a = self.tokens, self.heads
        mask = kernels.dropout_mask_bytes or element
        if eager:  # probabilities, and with dropout their dropped-out copy and mask (Korthikanti's 5as²b at e=2)
            return a * s * s * (element + (element + mask if self.attention_dropout else 0))
        kept = a * s * s * element * kernels.sdpa_dropout_matrices if self.attention_dropout else 0
        if kernels.sdpa_mask_copy and self.masked and not kept:
            kept = s * s * element
        return kept

    def layer_bytes(self, samples: int, element: int, kernels: Kernels, eager: bool) -> float:
        """Activations one layer keeps for backward (see the module docstring)."""
        s, h, i = self.tokens, self.hidden, self.intermediate
        per_sample = s * (8 * element * h + self.mlp_tensors * element * i)
        if element < FP32:
            per_sample += s * h * AUTOCAST_EXTRA_BYTES
        if self.hidden_dropout:
            per_sample += 2 * (kernels.dropout_mask_bytes or element) * s * h  # after attention and after the MLP
        per_sample += self._attention_matrix_bytes(element, kernels, eager)
        return samples * per_sample

    def activation_bytes(
        self, samples: int, element: int, kernels: Kernels, eager: bool, checkpointing: bool
    ) -> float:
        if samples == 0:
            return 0.0
        ends = 2 * element * samples * self.tokens * self.hidden  # embedding norm input, final hidden state (pooling)
        if element < FP32:  # the embedding norm's input is kept in fp32 under autocast
            ends += (FP32 - element) * samples * self.tokens * self.hidden
        layer = self.layer_bytes(samples, element, kernels, eager)
        if checkpointing:  # each layer's input, plus one layer's full set while it is recomputed
            inputs = self.layers * element * samples * self.tokens * self.hidden
            return ends + inputs + layer
        return ends + self.layers * layer

    def layer_parameters(self) -> int:
        """Weights of one layer (attention 4h² + MLP 2hi), the unit FSDP/ZeRO-3 gather at a time."""
        return 4 * self.hidden**2 + 2 * self.hidden * self.intermediate


@dataclass(frozen=True)
class CountedShape:
    """A model that counts its own activations (`activation_elements`, e.g. the BLIP3-o DiT): per sample, in an fp32
    run, and under 16-bit autocast as (fp32, 16-bit) elements. No checkpointing term: such models train without it."""

    layers: int
    hidden: int
    tokens: int  # per sample (shown in the table)
    block_parameters: int  # weights of one repeated block: what FSDP/ZeRO-3 gather at a time
    fp32_elements: int  # per sample, fp32 run
    autocast_elements: tuple[int, int]  # per sample under autocast: (fp32, 16-bit)

    def activation_bytes(
        self, samples: int, element: int, kernels: Kernels, eager: bool, checkpointing: bool
    ) -> float:
        if element == FP32:
            return samples * FP32 * self.fp32_elements
        wide, narrow = self.autocast_elements
        return samples * (FP32 * wide + element * narrow)

    def layer_parameters(self) -> int:
        return self.block_parameters


@dataclass(frozen=True)
class ModelSize:
    total: int  # every parameter
    trainable: int  # trainable when fully fine-tuned (frozen poolers / loss scalars excluded)
    trainable_lora: int  # trainable with the recipe's LoRA settings (adapters + whatever stays trainable outside)
    encoders: dict[str, EncoderShape | CountedShape]
    embedding_dim: int
    # role ("query", "document"; "sample" for a model without sides) -> encoder -> tokens per side: which encoders
    # each side passes through, and how long its sequence is there (see EmbeddingAdapter.planning_tokens)
    routes: dict[str, dict[str, int]] = field(default_factory=dict)
    contrastive: bool = True  # the loss scores a batch × batch matrix (gathered across devices)
    lora: bool = True  # the model can train with LoRA (else LoRA strategies are not planned)
    gradient_cache: bool = True  # the model's task can train with GradCache
    batch_name: str = "contrastive"  # what the plan calls the global batch (the task's `plan_batch`)
    checkpointing: bool = True  # the model can train with gradient checkpointing (else its ckpt column repeats acts)
    # samples encoded per forward chunk, each chunk checkpointed (a reranker's pairs_per_chunk): the activations of
    # one chunk are alive at a time, not the whole batch's
    chunk_samples: int | None = None


# The roles an example holds 1 + hard negatives of: a contrastive example's documents, a reranker's list of
# (query, document) pairs (each read jointly by one encoder: `CrossEncoderAdapter.planning_tokens`).
PAIR_ROLE = "pair"
LISTED_ROLES = ("document", PAIR_ROLE)


def default_routes(encoders: dict[str, EncoderShape]) -> dict[str, dict[str, int]]:
    """Queries go to the text encoder, documents (positive + hard negatives) to the image encoder when there is one:
    the image–text retrieval case of two-tower models. Text-only adapters embed every side as text."""
    query = "text" if "text" in encoders else "image"
    documents = "image" if "image" in encoders else "text"
    return {"query": {query: encoders[query].tokens}, "document": {documents: encoders[documents].tokens}}


def measure_model(recipe: "Recipe", with_lora: bool = True) -> ModelSize:
    """Parameter counts of the recipe's adapter (and its loss's own parameters) from the meta device; no weights.

    `with_lora=False` skips counting what LoRA would leave trainable (it imports peft, ~0.2 s of a run's start-up)
    for callers that only estimate the recipe's own setting; `trainable_lora` then equals `trainable`."""
    from vembed.components import loss_class, model_class
    from vembed.tasks import task_for

    import inspect

    adapter_cls = model_class(recipe)
    adapter: EmbeddingAdapter = adapter_cls.on_meta(recipe)
    # The Matryoshka wrapper adds no parameters: the loss's own are all there are. A loss with weights of the
    # embedding's size (ArcFace's centres) is told it, as the task tells it when training.
    loss_cls = loss_class(recipe)
    sizes = ({"embedding_dim": adapter.embedding_dim}
             if "embedding_dim" in inspect.signature(loss_cls.from_recipe).parameters else {})
    loss_parameters = sum(p.numel() for p in loss_cls.from_recipe(recipe, **sizes).parameters() if p.requires_grad)
    total = sum(p.numel() for p in adapter.parameters()) + loss_parameters
    trainable = sum(p.numel() for p in adapter.parameters() if p.requires_grad) + loss_parameters
    task = task_for(recipe)  # what its loss holds and whether GradCache can serve it are the task's
    if hasattr(adapter, "activation_elements"):
        return _counted_model(adapter, recipe, total, trainable, task.plan_batch)
    routes = adapter.planning_tokens(recipe)
    # An encoder's shape carries the longest sequence any side gives it (what the table shows); the activations
    # use each route's own length.
    longest = {name: max(tokens[name] for tokens in routes.values() if name in tokens)
               for name in {name for tokens in routes.values() for name in tokens}} if routes else {}
    encoders = {
        modality: EncoderShape.from_config(config, modality, adapter.settings.max_length, longest.get(modality))
        for modality, config in adapter.encoder_configs().items()
    }
    lora = trainable
    if with_lora:
        adapter.apply_lora(recipe)
        lora = sum(p.numel() for p in adapter.parameters() if p.requires_grad) + loss_parameters
    training = dict(contrastive=task.batch_wide_loss, gradient_cache=task.uses_gradient_cache,
                    batch_name=task.plan_batch)
    if routes and PAIR_ROLE in routes:  # a reranker: pairs read jointly, one score each, no embeddings
        return ModelSize(total, trainable, lora, encoders, 1, routes, **training,
                         chunk_samples=getattr(adapter.settings, "pairs_per_chunk", None))
    return ModelSize(total, trainable, lora, encoders, adapter.embedding_dim, routes or default_routes(encoders),
                     **training)


def _counted_model(model, recipe: "Recipe", total: int, trainable: int, batch_name: str) -> ModelSize:
    """The BLIP3-o DiT: one pass per sample through its blocks, activations counted by the model itself; it trains
    without LoRA, GradCache or checkpointing (FlowMatchingTask.check_recipe refuses them)."""
    config = model.config
    cosine = recipe.loss.flow.cosine_weight > 0
    shape = CountedShape(
        layers=config.num_layers, hidden=config.hidden_size, tokens=config.num_tokens,
        block_parameters=sum(p.numel() for p in model.blocks[0].parameters()) if config.num_layers else 0,
        fp32_elements=model.activation_elements(autocast=False, cosine_loss=cosine)[0],
        autocast_elements=model.activation_elements(autocast=True, cosine_loss=cosine),
    )
    return ModelSize(total, trainable, trainable, {"dit": shape}, config.clip_dim,
                     routes={"sample": {"dit": config.num_tokens}}, contrastive=False, lora=False,
                     gradient_cache=False, checkpointing=False, batch_name=batch_name)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step pushes through each device."""

    batch_size: int  # examples per device
    gpus: int
    sides: dict[str, int]  # sides per example passing through each encoder (a side may pass through several)
    roles: dict[str, int]  # sides per example of each role: 1 query, 1 + negatives documents
    negatives: int  # hard negatives per example
    element: int  # bytes per activation element: 4 (fp32) or 2 (bf16/fp16 autocast)
    mixed_precision: bool
    eager_attention: bool
    symmetric_loss: bool
    kernels: Kernels = KERNELS["cuda"]

    @property
    def contrastive_batch(self) -> int:
        return self.batch_size * self.gpus


def workload_for(recipe: "Recipe", model: ModelSize, gpus: int, device: str = "cuda") -> Workload:
    """Each example is one query and 1 + hard negatives documents (or, for a model without sides, one sample),
    routed through the encoders by `model.routes`."""
    listed = [role for role in model.routes if role in LISTED_ROLES]
    negatives = (recipe.data.num_hard_negatives or 0) if listed else 0
    roles = {role: 1 + negatives if role in listed else 1 for role in model.routes}
    sides = dict.fromkeys(model.encoders, 0)
    for role, count in roles.items():
        for name in model.routes[role]:
            sides[name] += count
    # Unset mixed_precision means "what the accelerate config says"; ours (ddp.yaml, fsdp.yaml) say bf16 on GPUs.
    precision = recipe.mixed_precision or "bf16"
    mixed = precision != "no"
    return Workload(
        batch_size=recipe.batch_size,
        gpus=gpus,
        sides=sides,
        roles=roles,
        negatives=negatives,
        element=2 if mixed else FP32,
        mixed_precision=mixed,
        eager_attention=getattr(recipe.model, "attn_implementation", None) == "eager",
        symmetric_loss=getattr(recipe.loss, "symmetric_loss", False),  # InfoNCE's option; SigLIP scores one way
        kernels=(PACKED_KERNELS if getattr(recipe.model, "packing", False) else KERNELS)[device],
    )


# --- strategies -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    """How a launch lays out model state; the numbers in the module docstring's table, as data."""

    name: str
    shard_parameters: bool = False  # FSDP, ZeRO-3
    shard_state: bool = False  # gradients and optimizer state divided by N (FSDP, ZeRO-2, ZeRO-3)
    ddp_buckets: bool = False  # DDP keeps a second copy of the gradients for all-reduce
    sixteen_bit_module: bool = False  # DeepSpeed: 16-bit module under mp, fp32 master in the optimizer
    offload: bool = False  # parameters, gradients and optimizer state live on the CPU
    lora: bool = False  # forces LoRA on (the recipe's use_lora applies to every strategy anyway)
    gradient_cache: bool = False
    accelerate_config: str = ""  # what to launch it with


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("single", accelerate_config="single.yaml"),
    Strategy("ddp", ddp_buckets=True, accelerate_config="ddp.yaml"),
    Strategy("ddp+gradcache", ddp_buckets=True, gradient_cache=True, accelerate_config="ddp.yaml"),
    Strategy("fsdp", shard_parameters=True, shard_state=True, accelerate_config="fsdp.yaml"),
    Strategy("fsdp+lora", shard_parameters=True, shard_state=True, lora=True, accelerate_config="fsdp.yaml"),
    Strategy("fsdp+lora+offload", shard_parameters=True, shard_state=True, lora=True, offload=True,
             accelerate_config="fsdp.yaml (cpu offload on)"),
    Strategy("zero2", shard_state=True, sixteen_bit_module=True, accelerate_config="deepspeed_zero2.yaml"),
    Strategy("zero3", shard_parameters=True, shard_state=True, sixteen_bit_module=True,
             accelerate_config="deepspeed_zero3.yaml"),
    Strategy("zero3+lora", shard_parameters=True, shard_state=True, sixteen_bit_module=True, lora=True,
             accelerate_config="deepspeed_zero3.yaml"),
    Strategy("zero3+offload", shard_parameters=True, shard_state=True, sixteen_bit_module=True, offload=True,
             accelerate_config="deepspeed_zero3_offload.yaml"),
)  # fmt: skip
STRATEGY_BY_NAME = {strategy.name: strategy for strategy in STRATEGIES}


@dataclass(frozen=True)
class Estimate:
    """Bytes per device for one strategy; `activations_checkpointed` is the same with gradient checkpointing."""

    strategy: Strategy
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    activations_checkpointed: float
    chunk_size: int | None = None  # GradCache: examples per forward chunk
    # The part of `gradients` that lives through the whole step (DDP's buckets, DeepSpeed's partition buffers); the
    # rest is freed by zero_grad(set_to_none=True) and only exists during backward.
    gradient_buffers: float = 0.0

    def total(self, checkpointing: bool) -> float:
        """The step's peak: during backward each layer's gradients appear as its activations are freed, so with
        per-layer sizes alike the peak is at one end, all activations (start) or all gradients (end)."""
        activations = self.activations_checkpointed if checkpointing else self.activations
        transient_gradients = self.gradients - self.gradient_buffers
        return self.parameters + self.optimizer + self.gradient_buffers + max(activations, transient_gradients)


def _activations(model: ModelSize, work: Workload, examples: int, checkpointing: bool) -> float:
    return sum(
        dataclasses.replace(model.encoders[name], tokens=tokens).activation_bytes(
            min(examples * count, model.chunk_samples or examples * count), work.element, work.kernels,
            work.eager_attention, checkpointing
        )
        for role, count in work.roles.items()
        for name, tokens in model.routes[role].items()
    )


def _loss_bytes(work: Workload) -> float:
    contrastive = work.contrastive_batch
    logits = contrastive * contrastive * (1 + work.negatives)
    return 3 * FP32 * logits * (2 if work.symmetric_loss else 1)


def estimate(
    strategy: Strategy, model: ModelSize, work: Workload, lora: bool, chunk_size: int | None = None
) -> Estimate:
    """Per-device bytes of `strategy`; `lora` is the recipe's use_lora (a strategy may force it on)."""
    n = work.gpus
    trainable = model.trainable_lora if (lora or strategy.lora) else model.trainable
    state_share = 1 / n if strategy.shard_state else 1.0
    # The largest layer of any encoder, unsharded in the compute dtype: what FSDP/ZeRO-3 gather at a time.
    gathered = GATHERED_LAYERS * max(e.layer_parameters() for e in model.encoders.values()) * work.element

    cast_cache = 0.0
    if strategy.sixteen_bit_module and work.mixed_precision:
        parameter_bytes, master = 2, FP32  # 16-bit module, fp32 master copy inside the optimizer
    else:
        parameter_bytes, master = FP32, 0
        if work.mixed_precision and not strategy.shard_parameters:
            # autocast's cached 16-bit copy of each weight, alive for the whole forward. torch caches only leaves that
            # require grad: frozen weights (LoRA's base, a frozen tower) are cast per use and freed at once. Counting
            # them over-planned Qwen3-VL-2B + LoRA by 4 GiB (measured on an H200, docs/benchmarks.md).
            cast_cache = 2 * trainable
    buffers = 0.0
    if strategy.offload:
        parameters = gathered
        gradients = optimizer = 0.0
    else:
        parameters = parameter_bytes * model.total * (1 / n if strategy.shard_parameters else 1.0) + cast_cache
        if strategy.shard_parameters:
            parameters += gathered
        gradients = FP32 * trainable * state_share * (2 if strategy.ddp_buckets else 1)
        if strategy.ddp_buckets:
            buffers = gradients / 2
        elif strategy.sixteen_bit_module:
            buffers = gradients  # DeepSpeed keeps its gradient partition in a persistent buffer
        optimizer = (2 * FP32 + master) * trainable * state_share

    examples = work.batch_size
    cache = 0.0
    if strategy.gradient_cache:
        examples = min(chunk_size or work.batch_size, work.batch_size)
        sides = sum(work.roles.values())
        cache = 2 * FP32 * work.contrastive_batch * sides * model.embedding_dim  # embeddings and their gradients
    extra = cache + (_loss_bytes(work) if model.contrastive else 0.0)  # a counted model includes its own loss
    return Estimate(
        strategy=strategy,
        parameters=parameters,
        gradients=gradients,
        gradient_buffers=buffers,
        optimizer=optimizer,
        activations=_activations(model, work, examples, False) + extra,
        activations_checkpointed=_activations(model, work, examples, True) + extra,
        chunk_size=examples if strategy.gradient_cache else None,
    )


# --- the plan -------------------------------------------------------------------------------------------------------
def usable_bytes(gpu_memory_gib: float) -> float:
    return max(gpu_memory_gib * USABLE_FRACTION - CUDA_CONTEXT_GIB, 0.0) * GIB


@dataclass
class MemoryPlan:
    """The memory plan `vembed plan` prints: each strategy's estimate per device for a recipe on `gpus` GPUs of
    `gpu_memory_gib`, and the one recommended. Not the launch plan (training/launch_plan.py's `LaunchPlan`: what this
    launch does), which it only advises."""

    recipe_path: str
    gpus: int
    gpu_memory_gib: float
    model: ModelSize
    work: Workload
    lora: bool  # the recipe's use_lora
    checkpointing: bool  # the recipe's gradient_checkpointing
    lora_r: int
    estimates: list[Estimate] = field(default_factory=list)
    recommendation: str = ""
    reason: str = ""

    @property
    def usable(self) -> float:
        return usable_bytes(self.gpu_memory_gib)

    def fits(self, estimate: Estimate, checkpointing: bool | None = None) -> bool:
        return estimate.total(self.checkpointing if checkpointing is None else checkpointing) <= self.usable


def _largest_fitting_chunk(model: ModelSize, work: Workload, lora: bool, usable: float,
                           checkpointing: bool) -> int | None:
    """The largest power-of-two chunk below the per-device batch whose GradCache step fits, or None (also when the
    model cannot train with GradCache)."""
    if not model.gradient_cache:
        return None
    strategy = STRATEGY_BY_NAME["ddp+gradcache"]
    chunk = 1
    best = None
    while chunk < work.batch_size:
        if estimate(strategy, model, work, lora, chunk).total(checkpointing) > usable:
            break
        best, chunk = chunk, chunk * 2
    return best


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _recommend(plan: MemoryPlan) -> tuple[str | None, str, str]:
    """(strategy name, recommendation, reason), the name None when nothing fits. The decision tree of the distributed-training guide we started from: fits on one device → DDP (single on
    one GPU); the model fits but not the batch → DDP + GradCache with a chunk that fits; the model does not fit →
    FSDP + LoRA, then ZeRO-3 + LoRA, then CPU offload. Gradient checkpointing is proposed whenever it is what makes a
    plan fit.
    """
    by_name = {e.strategy.name: e for e in plan.estimates}
    usable = _gib(plan.usable)

    def first_fit(name: str) -> tuple[bool, bool] | None:
        """(fits, needs checkpointing) for the recipe's setting first, then with checkpointing."""
        for checkpointing in dict.fromkeys((plan.checkpointing, True)):
            if plan.fits(by_name[name], checkpointing):
                return True, checkpointing and not plan.checkpointing
        return None

    def with_ckpt(text: str, needs: bool) -> str:
        return text + (" with gradient_checkpointing: true" if needs else "")

    base = "single" if plan.gpus == 1 else "ddp"
    hit = first_fit(base)
    if hit:
        total = by_name[base].total(plan.checkpointing or hit[1])
        label = "single device" if base == "single" else "DDP"
        return base, with_ckpt(label, hit[1]), (
            f"the model and a batch of {plan.work.batch_size} fit on one device ({_gib(total)} of {usable})")

    for checkpointing in dict.fromkeys((plan.checkpointing, True)):
        chunk = _largest_fitting_chunk(plan.model, plan.work, plan.lora, plan.usable, checkpointing)
        if chunk is not None:
            label = "GradCache" if plan.gpus == 1 else "DDP + GradCache"
            needs = checkpointing and not plan.checkpointing
            return "ddp+gradcache", with_ckpt(
                f"{label} (use_gradient_cache: true, gradient_cache_chunk_size: {chunk})", needs), (
                f"the model fits but a batch of {plan.work.batch_size} does not; chunks of {chunk} keep the "
                f"contrastive batch of {plan.work.contrastive_batch}")

    if plan.model.lora:
        sharded = (("fsdp+lora", "FSDP + LoRA"), ("zero3+lora", "ZeRO-3 + LoRA"),
                   ("fsdp+lora+offload", "FSDP + LoRA + CPU offload"), ("zero3+offload", "ZeRO-3 + CPU offload"))
    else:  # a model that trains without LoRA shards its full state
        sharded = (("fsdp", "FSDP"), ("zero3", "ZeRO-3"), ("zero3+offload", "ZeRO-3 + CPU offload"))
    with_lora = " with LoRA" if plan.model.lora else ""
    for name, label in sharded:
        hit = first_fit(name)
        if hit:
            total = by_name[name].total(plan.checkpointing or hit[1])
            return name, with_ckpt(label, hit[1]), (
                f"the full model does not fit on one device; sharded over {plan.gpus}{with_lora} it takes "
                f"{_gib(total)} of {usable}")
    last = "FSDP + LoRA + CPU offload with checkpointing" if plan.model.lora else "ZeRO-3 + CPU offload"
    return None, "none fits", (
        f"even {last} needs more than {usable} per device; lower batch_size, use more or larger GPUs, or a smaller "
        "model")


def _as_the_run_does_it(recipe: "Recipe", plan: MemoryPlan, name: str | None, recommendation: str,
                        reason: str) -> tuple[str, str]:
    """The recommendation as the launch will carry it out: GradCache on or off is the run's rule
    (`choose_gradient_cache`), so the plan asks the same rule instead of recommending what the run would not do."""
    if name is None:
        return recommendation, reason
    strategy = STRATEGY_BY_NAME[name]
    kind: LaunchKind = ("fsdp" if name.startswith("fsdp") else "deepspeed" if name.startswith("zero")
                        else "ddp" if plan.gpus > 1 else "single")
    # the recipe as the recommendation leaves it: checkpointing may be what it proposes (and what turns the rule on)
    proposed = recipe.model_copy(update={"gradient_checkpointing": True}) if "gradient_checkpointing: true" in \
        recommendation else recipe
    try:
        choice = choose_gradient_cache(proposed, kind, plan.model.total)
    except RecipeError as refused:
        return f"{recommendation}, and use_gradient_cache: false", f"{reason}; {refused.message}"
    if strategy.gradient_cache or not choice.enabled:
        return recommendation, reason
    # DDP or one device, and the run turns GradCache on by itself: say so (it only lowers memory, so it still fits)
    return (f"{recommendation} + GradCache (gradient_cache_chunk_size: {choice.chunk_size})",
            f"{reason}; GradCache is {choice.reason}")


def planned_strategies(model: ModelSize) -> list[Strategy]:
    """The strategies the model can train with: all of them, less LoRA and GradCache ones where it has neither."""
    return [s for s in STRATEGIES if (model.lora or not s.lora) and (model.gradient_cache or not s.gradient_cache)]


def make_plan(recipe: "Recipe", gpus: int, gpu_memory_gib: float, recipe_path: str = "") -> MemoryPlan:
    """Estimate every strategy for `recipe` on `gpus` devices of `gpu_memory_gib` GiB and pick one."""
    if gpus < 1:
        raise RecipeError("--gpus", f"must be at least 1, got {gpus}")
    if gpu_memory_gib <= 0:
        raise RecipeError("--gpu-memory", f"must be a positive number of GiB, got {gpu_memory_gib}")
    model = measure_model(recipe)
    work = workload_for(recipe, model, gpus)
    plan = MemoryPlan(recipe_path, gpus, gpu_memory_gib, model, work, recipe.use_lora, recipe.gradient_checkpointing,
                recipe.lora_r)
    chunk = recipe.gradient_cache_chunk_size
    if chunk is None:  # no chunk in the recipe: show the one we would recommend (1 when none fits)
        chunk = _largest_fitting_chunk(model, work, recipe.use_lora, plan.usable, recipe.gradient_checkpointing) or 1
    plan.estimates = [estimate(strategy, model, work, recipe.use_lora, chunk) for strategy in planned_strategies(model)]
    name, recommendation, reason = _recommend(plan)
    plan.recommendation, plan.reason = _as_the_run_does_it(recipe, plan, name, recommendation, reason)
    return plan


def format_plan(plan: MemoryPlan) -> str:
    """The table `vembed plan` prints: GiB per device, each strategy, with and without gradient checkpointing."""
    work, model = plan.work, plan.model
    precision = "bf16/fp16 autocast" if work.mixed_precision else "fp32"
    sides = "; ".join(
        f"{work.roles[role]} {role} → " + " + ".join(f"{name} {tokens} tokens" for name, tokens in route.items())
        for role, route in model.routes.items())
    shapes = ", ".join(f"{m} {e.layers} layers × {e.hidden}" for m, e in model.encoders.items())
    batch = model.batch_name
    lora = f"{model.trainable_lora:,} with LoRA (r={plan.lora_r})" if model.lora else "no LoRA for this model"
    lines = [
        f"vembed plan {plan.recipe_path}: {plan.gpus} GPU(s) × {plan.gpu_memory_gib:g} GiB "
        f"(usable {_gib(plan.usable)}: {USABLE_FRACTION:.0%} less {CUDA_CONTEXT_GIB} GiB CUDA context)",
        f"parameters   {model.total:,} total, {model.trainable:,} trainable, {lora}",
        f"batch        {work.batch_size} per device × {plan.gpus} = {work.contrastive_batch} {batch}; sides per "
        f"example: {sides}; {shapes}; {precision}",
        "",
        f"{'GiB per device':<26}{'params':>8}{'grads':>8}{'optim':>8}{'acts':>8}{'ckpt':>8}"
        f"{'total':>8}{'+ckpt':>8}  fits",
    ]
    for e in plan.estimates:
        name = e.strategy.name + (f" (chunk {e.chunk_size})" if e.chunk_size else "")
        fits = "yes" if plan.fits(e) else ("ckpt" if plan.fits(e, True) else "no")
        values = (e.parameters, e.gradients, e.optimizer, e.activations, e.activations_checkpointed,
                  e.total(False), e.total(True))
        lines.append(f"{name:<26}" + "".join(f"{v / GIB:>8.2f}" for v in values) + f"  {fits}")
    lines += [
        "",
        "fits: yes; ckpt = only with gradient_checkpointing; no. acts/ckpt: activations without/with checkpointing"
        + ("." if model.checkpointing else " (this model trains without checkpointing: the same)."),
        f"recommendation: {plan.recommendation} — {plan.reason}",
    ]
    return "\n".join(lines)



def with_tokens(model: ModelSize, tokens_per_role: dict[str, int]) -> ModelSize:
    """`model` with the sequence length of each role's sides set from data (e.g. a batch's mean real length when
    packed, its padded width when not) instead of max_length; roles not named keep theirs."""
    routes = {role: {name: tokens_per_role.get(role, tokens) for name, tokens in route.items()}
              for role, route in model.routes.items()}
    return dataclasses.replace(model, routes=routes)


def estimate_line(recipe: "Recipe", strategy: str, gpus: int, device: str = "cuda",
                  tokens_per_role: dict[str, int] | None = None) -> str:
    """One line for the block a run prints at start: this launch's per-device estimate, e.g.
    `memory estimate     6.2 GiB per device (params 0.6, grads 0.8, optimizer 0.8, activations 4.0)`.
    `tokens_per_role` (query, document, pair) replaces max_length with the data's lengths (`with_tokens`)."""
    if strategy not in STRATEGY_BY_NAME:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGY_BY_NAME)}")
    model = measure_model(recipe, with_lora=recipe.use_lora or STRATEGY_BY_NAME[strategy].lora)
    if tokens_per_role:
        model = with_tokens(model, tokens_per_role)
    e = estimate(STRATEGY_BY_NAME[strategy], model, workload_for(recipe, model, gpus, device), recipe.use_lora,
                 recipe.gradient_cache_chunk_size)
    activations = e.activations_checkpointed if recipe.gradient_checkpointing else e.activations
    total = e.total(recipe.gradient_checkpointing)
    unit, scale = ("GiB", GIB) if total >= GIB else ("MiB", 2**20)  # tiny models would read "0.0 GiB"
    parts = ", ".join(f"{name} {value / scale:.1f}" for name, value in (
        ("params", e.parameters), ("grads", e.gradients), ("optimizer", e.optimizer), ("activations", activations)))
    return f"memory estimate     {total / scale:.1f} {unit} per device ({parts}; vembed plan explains)"
