"""Packed batches (`packing: true`): a side's texts run through the encoder as ONE row of their real tokens, without
padding; position ids restart at each text and attention stays within it.

On CUDA the attention is torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`, torch 2.10
and later, bf16/fp16) in one launch over the packed tokens: the padding a padded batch computes is skipped without the
extra launches of length-sorted chunks (`length_chunks`), which lose on a GPU at short lengths (docs/benchmarks.md).
Elsewhere (CPU, fp32, older torch) each text attends on its own through SDPA: exact, and what the tests compare with the
padded path. The encoder's output is put back into the padded (rows, positions) layout, so pooling, token vectors,
SPLADE pooling and MaxSim read it as they read a padded batch.

The attention reaches the model through transformers' `AttentionInterface` (registered as `vembed_packed`): any
architecture whose attention layers call the configured attention function and pass the forward's keyword arguments
down (BERT and its family, ModernBERT, CLIP's text tower, the Qwen language models in transformers 5) packs; the
sequence boundaries travel as the `cu_seq_lens_q`/`max_length_q` keyword arguments transformers defines for packed
flash attention, so activation checkpointing recomputes with them.

Dropout: a hidden-state dropout draws one mask value per real token and feature in packed order, so a text's masks
do not depend on how much padding its batch had. Attention-probability dropout is not applied under packing:
`varlen_attn` has none, and the CPU path matches the GPU's (the recipe's explanation says so when the model sets it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


logger = logging.getLogger(__name__)
PACKED_ATTENTION = "vembed_packed"  # the name the attention function is registered under in transformers
VARLEN_TORCH = "2.10"  # the first torch with torch.nn.attention.varlen.varlen_attn
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what the flash kernel computes in


@dataclass(frozen=True)
class Packing:
    """Where a padded side's real tokens are: `flat` indexes them in the flattened (rows x positions) layout, in
    row-major order (the packed order); `cu_seq_lens` are the texts' boundaries in the packed row."""

    shape: tuple[int, int]
    flat: torch.Tensor  # (tokens,) int64
    cu_seq_lens: torch.Tensor  # (rows + 1,) int32
    max_length: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "Packing":
        keep = attention_mask.bool()
        lengths = keep.sum(dim=1)
        cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        # one host sync per side: the packed row's length and the longest text are the kernel's arguments
        return cls(shape=tuple(keep.shape), flat=keep.flatten().nonzero().squeeze(1), cu_seq_lens=cu_seq_lens,
                   max_length=int(lengths.max()) if len(lengths) else 0)

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """A padded (rows, positions, ...) tensor's real tokens as one row: (1, tokens, ...)."""
        return values.flatten(0, 1).index_select(0, self.flat).unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, tokens, ...) back to (rows, positions, ...), zeros where there was padding."""
        rows, positions = self.shape
        out = packed.new_zeros((rows * positions, *packed.shape[2:]))
        return out.index_copy(0, self.flat, packed[0]).view(rows, positions, *packed.shape[2:])

    def position_ids(self, offset: int = 0) -> torch.Tensor:
        """(1, tokens): each token's place in its own text, restarting at `offset` for every text."""
        starts = torch.repeat_interleave(self.cu_seq_lens[:-1].long(), self.cu_seq_lens.diff().long())
        return (torch.arange(len(self.flat), device=self.flat.device) - starts + offset).unsqueeze(0)

    def attention_arguments(self) -> dict[str, Any]:
        """The keyword arguments that carry the boundaries to the attention function (transformers' names)."""
        return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}


def packed_forward(model: "PreTrainedModel", tokens: dict[str, torch.Tensor], read: Callable[[Any], torch.Tensor],
                   accepted: frozenset[str] | set[str] = frozenset(), position_offset: int = 0) -> torch.Tensor:
    """`read(model(**tokens))` for a padded batch of texts, computed packed; the result in the padded layout.

    `tokens` holds the model's text inputs (input_ids, attention_mask, token_type_ids, ...) of shape (rows,
    positions); `read` picks the per-token output (last_hidden_state, logits); `accepted` names the model's forward
    arguments; `position_offset` is the model's first position id (`first_position`)."""
    packing = Packing.of(tokens["attention_mask"])
    packed = _packed_inputs(packing, tokens, accepted, position_offset)
    return packing.unpack(read(model(**packed, **packing.attention_arguments())))


def packed_below_head(model: "PreTrainedModel", stack: torch.nn.Module, tokens: dict[str, torch.Tensor],
                      accepted: frozenset[str] | set[str] = frozenset(), position_offset: int = 0) -> Any:
    """`model(**tokens)` with the layer `stack` run packed and its output put back in the padded layout, so that
    what reads it (BERT's pooler, a classification head at the first token) reads a padded batch."""
    packing = Packing.of(tokens["attention_mask"])

    def unpack_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple) and not hasattr(output, "last_hidden_state"):
            return (packing.unpack(output[0]), *output[1:])
        output.last_hidden_state = packing.unpack(output.last_hidden_state)  # a ModelOutput: key and attribute
        return output

    handle = stack.register_forward_hook(unpack_output)
    try:
        return model(**_packed_inputs(packing, tokens, accepted, position_offset), **packing.attention_arguments())
    finally:
        handle.remove()


def layer_stack(model: "PreTrainedModel") -> str | None:
    """The name (for `get_submodule`) of the module that runs a text model's layers and returns per-token states
    before any pooling (BERT's family: `encoder`; DistilBERT: `transformer`), or None when the model has none."""
    prefix = model.base_model_prefix if isinstance(getattr(model, model.base_model_prefix, None),
                                                   torch.nn.Module) else ""
    for name in ("encoder", "transformer"):
        dotted = f"{prefix}.{name}" if prefix else name
        try:
            model.get_submodule(dotted)
        except AttributeError:
            continue
        return dotted
    return None


def _packed_inputs(packing: Packing, tokens: dict[str, torch.Tensor], accepted: frozenset[str] | set[str],
                   position_offset: int) -> dict[str, torch.Tensor]:
    mask = tokens["attention_mask"]
    packed = {key: packing.pack(value) for key, value in tokens.items()
              if key != "attention_mask" and value.dim() >= 2 and value.shape[:2] == mask.shape}
    packed["position_ids"] = packing.position_ids(position_offset)
    if "token_type_ids" in accepted and "token_type_ids" not in packed:
        # BERT's default token types are a buffer as long as its position table, shorter than a packed row
        packed["token_type_ids"] = torch.zeros_like(packed["input_ids"])
    return packed


def first_position(model: torch.nn.Module) -> int:
    """The position id of a text's first token as the model numbers them itself: RoBERTa's family counts positions
    after its padding index (its position table has one), BERT's and the rest from 0."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding):
            return 0 if module.padding_idx is None else module.padding_idx + 1
    return 0


def varlen_attn_function() -> Callable[..., torch.Tensor] | None:
    """torch's variable-length flash attention, or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, sliding_window: int | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (batch, heads, tokens, head_dim) in, (batch, tokens, heads,
    head_dim) out; the batch is one packed row whose texts attend only within themselves (`cu_seq_lens_q`).
    `sliding_window` w (ModernBERT's local layers) lets a token see those at most w - 1 positions away, as
    transformers' flash path reads it. `dropout` is never
    applied (module docstring)."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    gqa = query.shape[1] != key.shape[1]
    if cu_seq_lens_q is None:  # transformers made no padding mask for this attention: a padded call would be wrong
        raise ValueError("a model set up for packing runs packed batches only (vembed.models.packing.packed_forward)")
    if len(query) != 1:
        raise ValueError(f"a packed batch is one row of tokens, got {len(query)} rows")
    reach = -1 if sliding_window is None else sliding_window - 1  # how far a token sees (-1: no limit)
    varlen = varlen_attn_function()
    if varlen is not None and query.is_cuda and query.dtype in VARLEN_DTYPES:
        out = _flash(varlen, query, key, value, cu_seq_lens_q, max_length_q, scaling, causal, reach, gqa)
        if out is not None:
            return out, None
    return _each_text_alone(query, key, value, cu_seq_lens_q, scaling, causal, gqa, reach), None


def _flash(varlen: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           cu_seq_lens: torch.Tensor, max_length: int, scaling: float | None, causal: bool, reach: int,
           gqa: bool) -> torch.Tensor | None:
    """`varlen_attn` over the packed row, (1, tokens, heads, head_dim); None when this torch's kernel lacks what the
    layer needs (a sliding window before torch grew `window_size`). torch 2.10's signature has `is_causal` and no
    scale, window or grouped-query heads; later ones have `scale`, `window_size` and `enable_gqa`."""
    accepts = _VARLEN_ACCEPTS.get("names") or _varlen_parameters(varlen)
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (tokens, heads, head_dim)
    options: dict[str, Any] = {}
    if "window_size" in accepts:
        options["window_size"] = (reach, 0 if causal else reach)
    elif reach >= 0:
        return None
    else:
        options["is_causal"] = causal
    if "scale" in accepts:
        options["scale"] = scaling
    elif scaling is not None:  # the kernel scales by head_dim ** -0.5: fold the layer's own scale into the queries
        q = q * (scaling * q.shape[-1] ** 0.5)
    if gqa and "enable_gqa" in accepts:
        options["enable_gqa"] = True
    elif gqa:
        k, v = (tensor.repeat_interleave(q.shape[1] // tensor.shape[1], dim=1) for tensor in (k, v))
    return varlen(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, **options).unsqueeze(0)


# The kernel's argument names, read once when a model is set up for packing: inspecting them inside a compiled tower
# would break its graph at every attention layer (seen on an H200 with `compile: true`).
_VARLEN_ACCEPTS: dict[str, frozenset[str]] = {}


@lru_cache(maxsize=4)
def _varlen_parameters(varlen: Callable[..., torch.Tensor]) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(varlen).parameters)


def _each_text_alone(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                     scaling: float | None, causal: bool, gqa: bool, reach: int) -> torch.Tensor:
    """The exact fallback: SDPA on each text's slice of the packed row; (1, tokens, heads, head_dim)."""
    bounds = cu_seq_lens.tolist()
    pieces = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop == start:
            continue
        allowed = None
        if reach >= 0 and stop - start > reach + 1:
            distance = torch.arange(stop - start, device=query.device)
            distance = distance[:, None] - distance[None, :]  # query position - key position
            allowed = (distance <= reach) & (distance >= (0 if causal else -reach))
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], attn_mask=allowed,
            scale=scaling, is_causal=causal and allowed is None, enable_gqa=gqa))
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous()


def use_packed_attention(model: "PreTrainedModel", sub_config: str | None = None) -> None:
    """Route `model`'s attention through `packed_attention` (registered with transformers once): every sub-model's,
    or only that of `sub_config` (a Qwen-VL's `text_config`: its vision tower packs images its own way)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    varlen = varlen_attn_function()
    if varlen is not None:
        _VARLEN_ACCEPTS["names"] = _varlen_parameters(varlen)
    if not packs_attention(type(model)):  # recipe_checks refuses it first; a direct Python caller meets this
        raise RecipeError("packing", inline_attention_reason(type(model).__name__))
    model.set_attn_implementation(PACKED_ATTENTION if sub_config is None else {sub_config: PACKED_ATTENTION})
    if next(model.parameters()).device.type != "meta":  # the planner's shapes-only copy says nothing
        for line in packing_lines(getattr(model.config, sub_config) if sub_config else model.config):
            logger.warning(line)


def packs_attention(model_class: type) -> bool:
    """Whether a transformers model class calls the configured attention function (MPNet, DeBERTa-v2 and other
    older architectures write their attention inline)."""
    return bool(getattr(model_class, "_supports_attention_backend", False))


def inline_attention_reason(name: str) -> str:
    return f"{name} computes its attention itself, so its texts cannot be packed; remove packing"


def packing_lines(config: Any) -> list[str]:
    """What a packed run of a model with `config` does differently from a padded one, a line each (logged once)."""
    lines = []
    dropped = max(float(getattr(config, key, 0.0) or 0.0) for key in ("attention_probs_dropout_prob",
                                                                        "attention_dropout"))
    if dropped > 0:
        lines.append(f"packing: the model's attention-probability dropout ({dropped:g}) is not applied (varlen "
                     "attention has none); its other dropout is")
    if torch.cuda.is_available() and varlen_attn_function() is None:
        lines.append(f"packing: torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= "
                     f"{VARLEN_TORCH} on CUDA); each text attends on its own, exact but slower")
    return lines
