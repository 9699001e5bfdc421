"""The batch layout of mixed text/image sides that the single-sequence-per-modality adapters (clip, siglip, text,
composed) share: splitting sides by modality, tokenising and processing them, fusing text+image rows back, and cutting
a batch into chunks (GradCache)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vembed.data.images import load_image

if TYPE_CHECKING:
    from vembed.data.records import ImageLike, Side

# `preprocess` returns one flat dict of tensors:
#   tokenizer outputs (input_ids, attention_mask, ...)  (n_text, seq): a row per side that has text, in side order
#   PIXEL_VALUES                                        (n_image, 3, H, W): a row per side that has an image
#   TEXT_INDEX, IMAGE_INDEX                             (n,) long: the side's row in the text / image tensors, or -1
# Text and image keys are absent when no side has that modality. Because rows are numbered in side order, any
# contiguous range of sides maps to a contiguous range of rows (`slice_batch` relies on this).
TEXT_INDEX = "text_index"
IMAGE_INDEX = "image_index"
PIXEL_VALUES = "pixel_values"
_LAYOUT_KEYS = (TEXT_INDEX, IMAGE_INDEX, PIXEL_VALUES)


def split_sides(sides: Sequence["Side"]) -> tuple[list[str], list["ImageLike"], dict[str, torch.Tensor]]:
    """The texts, the images and the TEXT_INDEX/IMAGE_INDEX layout of a list of sides."""
    texts: list[str] = []
    images: list[ImageLike] = []
    text_index, image_index = [], []
    for i, side in enumerate(sides):
        has_text = bool(side.text and side.text.strip())  # as in Side.is_empty: blank text counts as none
        if len(side.images) > 1:  # several images per side: only qwen_vl embeds more than one
            raise ValueError(f"side {i} of the batch has {len(side.images)} images; this model embeds one image per "
                             "side (model_type qwen_vl takes several)")
        image = side.images[0] if side.images else None
        if not has_text and image is None:
            raise ValueError(f"side {i} of the batch has neither text nor an image; empty sides cannot be embedded")
        text_index.append(len(texts) if has_text else -1)
        image_index.append(len(images) if image is not None else -1)
        if has_text:
            texts.append(side.text)
        if image is not None:
            images.append(image)
    layout = {
        TEXT_INDEX: torch.tensor(text_index, dtype=torch.long),
        IMAGE_INDEX: torch.tensor(image_index, dtype=torch.long),
    }
    return texts, images, layout


def make_batch(
    sides: Sequence["Side"],
    tokenizer: Any,
    image_processor: Any | None,
    *,
    max_length: int | None,
    text_keys: Iterable[str],
    padding: str = "longest",
    add_special_tokens: bool = True,
) -> dict[str, torch.Tensor]:
    """Tokenise the texts and process the images of `sides` into the flat layout above.

    Only tokenizer outputs named in `text_keys` are kept (the text tower's forward arguments), because e.g. a
    tokenizer returning token_type_ids would break a CLIP text tower.
    """
    texts, images, batch = split_sides(sides)
    if texts:
        encoded = tokenizer(texts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt",
                            add_special_tokens=add_special_tokens)
        keep = set(text_keys)
        batch.update({key: value for key, value in encoded.items() if key in keep})
    if images:
        if image_processor is None:
            raise ValueError(
                "this model embeds text only, but the batch has images; use model_type clip, siglip or composed"
            )
        batch[PIXEL_VALUES] = process_images(images, image_processor)
    return batch


def process_images(images: Sequence[Any], image_processor: Any) -> torch.Tensor:
    """pixel_values (n, 3, H, W) of a batch of images: paths and PIL images through the processor, cached pixels
    (`CachedPixels`, already resized by it) rescaled and normalised as one batched lookup, in batch order."""
    from vembed.data.image_cache import CachedPixels, normalise

    cached = [i for i, image in enumerate(images) if isinstance(image, CachedPixels)]
    if not cached:
        return image_processor(images=[load_image(image) for image in images], return_tensors="pt")["pixel_values"]
    import numpy as np

    normalised = normalise(np.stack([images[i].pixels for i in cached]), image_processor)
    if len(cached) == len(images):
        return normalised
    rest = [i for i, image in enumerate(images) if not isinstance(image, CachedPixels)]
    processed = image_processor(images=[load_image(images[i]) for i in rest], return_tensors="pt")["pixel_values"]
    out = torch.empty((len(images), *normalised.shape[1:]), dtype=normalised.dtype)
    out[cached], out[rest] = normalised, processed.to(normalised.dtype)
    return out


def text_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The tokenizer outputs of a batch, or None when the batch has no text."""
    found = {key: value for key, value in inputs.items() if key not in _LAYOUT_KEYS}
    return found or None


def forward_argument_names(function: Any) -> set[str]:
    """Named parameters of a forward function: which tokenizer outputs a tower accepts."""
    return {
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }


def combine(
    text: torch.Tensor | None,
    image: torch.Tensor | None,
    inputs: dict[str, torch.Tensor],
    normalize: bool,
) -> torch.Tensor:
    """Put text and image embeddings back in side order; a side with both gets the fused embedding.

    Fusion: the L2-normalised sum of the L2-normalised text and image embeddings (so both count equally whatever
    their norms); fused rows are therefore unit-norm even when `normalize` is false. Output is float32 so the loss
    never runs in half precision.
    """
    text_index, image_index = inputs[TEXT_INDEX], inputs[IMAGE_INDEX]
    text_rows, image_rows = _gather(text, text_index), _gather(image, image_index)
    if text_rows is None and image_rows is None:
        raise ValueError("empty batch: no text and no image rows")
    if text_rows is None:
        out = image_rows
    elif image_rows is None:
        out = text_rows
    else:
        both = ((text_index >= 0) & (image_index >= 0)).unsqueeze(-1)
        fused = F.normalize(F.normalize(text_rows, dim=-1) + F.normalize(image_rows, dim=-1), dim=-1)
        # Single-modality rows have zeros for the missing part, so the plain sum is just the present embedding.
        out = torch.where(both, fused, text_rows + image_rows)
    return F.normalize(out, dim=-1) if normalize else out


def _gather(embeddings: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """One row per side (zeros where the side lacks this modality); indexing keeps the graph differentiable."""
    if embeddings is None:
        return None
    present = (index >= 0).unsqueeze(-1)
    return embeddings.float()[index.clamp(min=0)] * present


def slice_batch(inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The preprocessed batch of sides `start:stop` (e.g. GradCache chunks), re-indexed to start at row 0."""
    out: dict[str, torch.Tensor] = {}
    text_keys = [key for key in inputs if key not in _LAYOUT_KEYS]
    for index_key, keys in ((TEXT_INDEX, text_keys), (IMAGE_INDEX, [PIXEL_VALUES])):
        index = inputs[index_key][start:stop]
        present = index[index >= 0]
        if len(present):
            first, last = int(present.min()), int(present.max()) + 1
            out.update({key: inputs[key][first:last] for key in keys})
            index = torch.where(index >= 0, index - first, index)
        out[index_key] = index
    return out

