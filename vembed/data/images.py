"""Open an image the one way every part of vembed does: fully decoded, RGB, file closed, errors as `DataError`."""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Union

from vembed.errors import DataError

if TYPE_CHECKING:
    from PIL import Image

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def to_rgb(image: "Image.Image") -> "Image.Image":
    """RGB copy of a PIL image; palette images with transparency go through RGBA first (avoids PIL's warning)."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert("RGB")


def load_image(path_or_pil: Union[str, os.PathLike, "Image.Image"]) -> "Image.Image":
    """A decoded RGB `PIL.Image` from a file path or an (possibly lazily opened) PIL image.

    Raises `DataError` naming the file when it is missing or cannot be decoded (truncated, not an image, ...), so
    callers can skip the record (see `PairDataset`) and users see which file is bad.
    """
    from PIL import Image

    if isinstance(path_or_pil, Image.Image):
        if isinstance(getattr(path_or_pil, "fp", None), io.BytesIO):
            # Lazily opened from embedded bytes (see sources): decode a fresh handle so the stored record stays small.
            path_or_pil = Image.open(io.BytesIO(path_or_pil.fp.getvalue()))
        try:
            path_or_pil.load()
            return to_rgb(path_or_pil)
        except Exception as err:  # noqa: BLE001 - PIL raises many types for bad data (OSError, ValueError, SyntaxError)
            name = getattr(path_or_pil, "filename", None) or None
            raise DataError(f"cannot decode image: {type(err).__name__}: {err}", file=name) from err
    path = os.fspath(path_or_pil)
    if not os.path.isfile(path):
        raise DataError("image file not found", file=path)
    try:
        with Image.open(path) as image:
            image.load()
            rgb = to_rgb(image)
            return rgb.copy() if rgb is image else rgb  # closing the file frees the decoded pixels of `image`
    except Exception as err:  # noqa: BLE001 - see above; DecompressionBombError is not an OSError either
        raise DataError(f"cannot decode image: {type(err).__name__}: {err}", file=path) from err
