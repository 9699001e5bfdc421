"""Open an image the one way every part of vembed does: fully decoded, RGB, file closed, errors as `DataError`."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
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


def check_images_decode(images: Sequence[Union[str, os.PathLike, "Image.Image"]], what: str) -> None:
    """Decode each of `images` once (paths once each), in threads (PIL decodes without the GIL): a `DataError` naming
    the first that does not decode, how many do not, and `what` they belong to (e.g. data.test). What the launch runs on
    the held-out splits before training: evaluation has no bad-record budget, so one bad image would stop the run at
    its evaluation, after checkpoints and final/ were written."""
    from concurrent.futures import ThreadPoolExecutor

    unique = list({os.fspath(image) if isinstance(image, (str, os.PathLike)) else id(image): image
                   for image in images}.values())
    if not unique:
        return

    def failure(image: Union[str, os.PathLike, "Image.Image"]) -> DataError | None:
        try:
            load_image(image)
        except DataError as error:
            return error
        return None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        failures = [error for error in pool.map(failure, unique) if error is not None]
    if failures:
        first = failures[0]
        raise DataError(f"{first.detail}; {len(failures)} of the {len(unique)} images of {what} do not decode, and "
                        "evaluation reads every one: fix or remove them before training", file=first.file)
