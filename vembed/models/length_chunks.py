"""Length-aware encoding: a side's texts run through the encoder in length-sorted chunks, each padded only to its own
longest row, and the embeddings are put back in batch order before the loss.

The contrastive batch, the loss and the gradients are those of one padded forward (up to float rounding) when dropout
is off: padding columns that no row attends change nothing an adapter computes when it pools from the attention mask
or at the EOS token (`EmbeddingAdapter.length_chunking`). SigLIP pools the last *position* of text padded to
max_length, so it stays out. Only the shared text/image layout (vembed/models/batch.py) is chunked; a side with images
keeps its order and has only the columns no row attends cut.

With dropout on, each chunk draws its masks from the run's generator in its own order, so a text gets other masks than
in the padded forward: another draw of the same distribution, deterministic given the seed. Masks that follow each text
whatever its chunk are possible (a hash of a row seed and the position) but cost unfused attention and a hook per
architecture (measured in bench/keyed_dropout_cost.py).

Written here rather than taken from a library: sentence-transformers sorts a whole dataset by length at encode time
(inference only), and the backends' unpadded attention (flash-attention varlen, SDPA on jagged tensors) is GPU-only
and model-specific; this keeps training exact (dropout off) for every adapter that opts in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vembed.models.batch import IMAGE_INDEX, PIXEL_VALUES, TEXT_INDEX
from vembed.models.token_vectors import cat_tokens


def _text_keys(inputs: dict[str, torch.Tensor]) -> list[str]:
    mask = inputs["attention_mask"]
    layout = (TEXT_INDEX, IMAGE_INDEX, PIXEL_VALUES)
    return [key for key, value in inputs.items()
            if key not in layout and value.dim() >= 2 and value.shape[:2] == mask.shape]


def trim_padding(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`inputs` without the trailing token columns that no row attends (right padding past the longest row)."""
    mask = inputs.get("attention_mask")
    if mask is None or mask.numel() == 0:
        return inputs
    attended = mask.any(dim=0).nonzero()
    width = int(attended.max()) + 1 if len(attended) else 1
    if width == mask.shape[1]:
        return inputs
    return {**inputs, **{key: inputs[key][:, :width] for key in _text_keys(inputs)}}


def is_text_only(inputs: dict[str, torch.Tensor]) -> bool:
    """True for a side of texts alone (no images): the sides whose rows may be regrouped by length."""
    index = inputs.get(TEXT_INDEX)
    return (index is not None and PIXEL_VALUES not in inputs and bool((index >= 0).all())
            and bool((inputs.get(IMAGE_INDEX, index.new_full((1,), -1)) < 0).all()))


def chunk_rows(mask: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """Row indices of each chunk: rows sorted by attended length (stable), cut into `chunks` near-equal parts."""
    order = torch.argsort(mask.sum(dim=1), stable=True)
    return [rows for rows in order.tensor_split(min(chunks, len(order))) if len(rows)]


def encode_by_length(encode: Callable[[dict[str, torch.Tensor]], torch.Tensor], inputs: dict[str, torch.Tensor],
                     chunks: int) -> torch.Tensor:
    """`encode(inputs)` computed as `chunks` length-sorted forwards (text-only sides), each trimmed to its longest
    row; embeddings returned in the rows' original order. Sides with images, or `chunks` <= 1: one trimmed forward."""
    mask = inputs.get("attention_mask")
    if mask is None or chunks <= 1 or not is_text_only(inputs) or len(mask) < 2:
        return encode(trim_padding(inputs))
    pieces, order = [], []
    for rows in chunk_rows(mask, chunks):
        pieces.append(encode(trim_padding(select_rows(inputs, rows))))
        order.append(rows)
    return in_batch_order(cat_tokens(pieces), torch.cat(order))


def select_rows(inputs: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The text-only side of `rows` (any order), laid out as `preprocess` would have made it for those texts alone."""
    part = {key: inputs[key][rows] for key in _text_keys(inputs)}
    part[TEXT_INDEX] = torch.arange(len(rows), device=rows.device)
    if IMAGE_INDEX in inputs:
        part[IMAGE_INDEX] = inputs[IMAGE_INDEX][rows]
    return part


def in_batch_order(embeddings: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`embeddings[i]` belongs to batch row `rows[i]`: return them with row r at position r."""
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(len(rows), device=rows.device)
    return embeddings.index_select(0, inverse.to(embeddings.device))


def padding_counts(mask: torch.Tensor, chunks: int) -> torch.Tensor:
    """(attended tokens, token positions of one padded forward, of `chunks` length-sorted chunks) of a side, as a
    tensor on the mask's device: no host sync, so the training loop can add it up every step."""
    lengths = mask.sum(dim=1)
    sorted_lengths = lengths.sort().values
    chunked = sum(len(part) * part.max() for part in sorted_lengths.tensor_split(max(1, min(chunks, len(lengths))))
                  if len(part))
    return torch.stack([lengths.sum(), lengths.new_tensor(mask.numel()), torch.as_tensor(chunked, device=mask.device)])
