"""Images decoded and resized once: uint8 pixels at the image processor's output size in a memory-mapped file that
every rank of a node shares, so an epoch reads pixels instead of decoding and resizing files. Rescaling and
normalising run batched in collation (`normalise`), with the processor's own arithmetic, so the pixel values are
bit-identical to the processor's."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vembed.errors import DataError

if TYPE_CHECKING:
    import torch

    from vembed.data.records import Example

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
# Processor settings applied after the cached pixels (in `normalise`, from the live processor): not part of the key.
_AFTER_CACHE = frozenset({"do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std"})


@dataclass(frozen=True)
class CachedPixels:
    """One image as the processor has it after resizing and cropping, before rescaling: uint8 (3, H, W)."""

    pixels: np.ndarray
    path: str


CACHE_DIR_ENV = "VEMBED_IMAGE_CACHE_DIR"


def default_cache_dir() -> Path:
    """$VEMBED_IMAGE_CACHE_DIR, else $XDG_CACHE_HOME/vembed/images (default ~/.cache): image files are often on
    read-only or shared storage, so the cache does not go beside them."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "vembed" / "images"


def cacheable_settings(processor: Any) -> dict[str, Any] | None:
    """The processor settings that decide the cached pixels, or None when its output is not one fixed size made by
    transformers' PIL backend steps (resize, centre crop, then rescale and normalise): e.g. Qwen-VL's dynamic
    resolution, padding, or a processor with its own `_preprocess`."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:
        return None
    if not isinstance(processor, PilBackend) or type(processor)._preprocess is not PilBackend._preprocess:
        return None
    if getattr(processor, "do_pad", None):
        return None
    if output_shape(processor) is None:
        return None
    settings = {k: v for k, v in processor.to_dict().items() if k not in _AFTER_CACHE}
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def output_shape(processor: Any) -> tuple[int, int] | None:
    """(height, width) every image comes out at, or None when it depends on the image."""
    crop, size = getattr(processor, "crop_size", None), getattr(processor, "size", None)
    if getattr(processor, "do_center_crop", False):
        if crop is not None and crop.height and crop.width:
            return int(crop.height), int(crop.width)
        return None
    if getattr(processor, "do_resize", False) and size is not None and size.height and size.width:
        return int(size.height), int(size.width)
    return None


def normalise(pixels: np.ndarray, processor: Any) -> "torch.Tensor":
    """uint8 (B, 3, H, W) -> what the processor's rescale and normalise make of them, bit for bit.

    Both steps work per value and channel, so the processor's own methods are run once on every uint8 value of every
    channel (a 3 x 256 table) and the batch is looked up in it: the same float64 rescale, float32 cast and float32
    (x - mean) / std as `PilBackend._preprocess`, without per-image numpy work. The lookup is numpy's `take` on the
    uint8 values: torch's indexing needs int64 indices (8 bytes per pixel) and its small multi-threaded kernels
    stall on a busy CPU (measured 50-70 ms against 0.2 ms for a batch of 64 32-px images, load average 10).
    """
    import torch

    table = np.tile(np.arange(256, dtype=np.uint8), (3, 1))[:, None, :]  # (3, 1, 256): a channel-first image
    if processor.do_rescale:
        table = processor.rescale(table, processor.rescale_factor)
    if processor.do_normalize:
        table = processor.normalize(table, processor.image_mean, processor.image_std)
    table = table.reshape(3, 256)
    out = np.empty(pixels.shape, dtype=table.dtype)
    for channel in range(3):
        np.take(table[channel], pixels[:, channel], out=out[:, channel])
    return torch.from_numpy(out)


def cache_applies(data: Any, adapter: Any) -> bool:
    """Whether a run's training images go through the cache: data.image_cache on, and an adapter whose images have
    one fixed size (its `image_cache` flag) and a processor."""
    return bool(data.image_cache) and type(adapter).image_cache and adapter.image_processor is not None


def cache_line(cache: "ImageCache | None") -> list[tuple[str, str]]:
    """The start block's line on the cache of a run's training images (none without one)."""
    if cache is None:
        return []
    how = "mapped" if cache.build_seconds is None else f"built in {cache.build_seconds:.1f} s"
    return [("image cache", f"{len(cache):,} images resized once, {how}: {cache.file}")]


def image_paths(examples: Iterable["Example"], num_negatives: int | None) -> list[str]:
    """Every image file the records use (query, positive, the negatives they keep), once each, sorted. Records made
    on fetch (`PairRows`, `CorpusPairs`) say it from their columns without making one (their negatives are already
    cut); a list of records is walked."""
    from_columns = getattr(examples, "image_paths", None)
    if from_columns is not None and num_negatives is None:
        return from_columns()
    found: set[str] = set()
    for example in examples:
        for side in (example.query, example.positive, *example.negatives[:num_negatives]):
            found.update(image for image in side.images if isinstance(image, str))
    return sorted(found)


def undecodable_records(examples: Sequence["Example"], cache: "ImageCache") -> tuple[int, int | None]:
    """(how many records use an image that did not decode when `cache` was built, the index of the first): known
    before training, since building the cache decoded every image. Walks the records only when there are such images."""
    if not cache.errors:
        return 0, None
    count, first = 0, None
    for index, example in enumerate(examples):
        sides = (example.query, example.positive, *example.negatives)
        if any(isinstance(image, str) and image in cache.errors for side in sides for image in side.images):
            count += 1
            first = index if first is None else first
    return count, first


class ImageCache:
    """Maps an image path to its cached pixels (`pixels(path)`), or raises the `DataError` decoding it raised when
    the cache was built. Pickles as its file name (DataLoader workers map the file again)."""

    def __init__(self, file: Path, paths: Sequence[str], errors: dict[str, tuple[str, str | None]]):
        self.file = Path(file)
        self.rows = {path: row for row, path in enumerate(paths)}
        self.errors = errors  # path -> (message, file) of the DataError its decoding raised
        self.build_seconds: float | None = None  # set when this process built it (None: mapped a built one)
        self._pixels: np.ndarray | None = None

    def __contains__(self, path: object) -> bool:
        return path in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def pixels(self, path: str) -> CachedPixels:
        if path in self.errors:
            message, file = self.errors[path]
            raise DataError(message, file=file)
        if self._pixels is None:
            self._pixels = np.load(self.file, mmap_mode="r")
        return CachedPixels(self._pixels[self.rows[path]], path)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pixels": None}


def open_image_cache(paths: Sequence[str], processor: Any, cache_dir: str | os.PathLike | None = None, *,
                     load: "Callable[[str], Any] | None" = None, stamp: "Callable[[str], str | None] | None" = None,
                     ) -> ImageCache | None:
    """The cache of `paths` (absolute, sorted, unique) at `processor`'s settings: mapped when built, else built
    first. None when the processor's output has no fixed size or the disk lacks room (the caller decodes as before).

    Keyed by each file's path, size and modification time and by the processor settings that shape the pixels, so a
    changed image or setting makes a new cache. One process per node builds it under a file lock while the others wait,
    then map it; it is written to a temporary name and renamed when complete, so an interrupted build is never read.
    Images that are no file (embedded in a table: vembed/classification/labelled.py) come with `load` (key -> decoded
    image, `DataError` when it cannot be) and `stamp` (key -> what changes when the image does, e.g. its table's files'
    sizes and times; None: a file, stat'ed as above).
    """
    settings = cacheable_settings(processor)
    if settings is None or not paths:
        return None
    height, width = output_shape(processor)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    key = _key(paths, settings, stamp)
    file = folder / f"images-{key}.npy"
    shape = (len(paths), 3, height, width)
    from filelock import FileLock

    build_seconds = None
    with FileLock(str(folder / f"images-{key}.lock")):
        errors = _read_complete(file, shape)
        if errors is None:
            need, free = int(np.prod(shape)), _free_bytes(folder)
            if need > free // 2:
                logger.warning("image cache off: %d images need %.1f GB, %s has %.1f GB free; images are decoded "
                               "every epoch", len(paths), need / 1e9, folder, free / 1e9)
                return None
            start = time.perf_counter()
            errors = _build(file, paths, processor, shape, load)
            build_seconds = time.perf_counter() - start
    cache = ImageCache(file, paths, errors)
    cache.build_seconds = build_seconds
    return cache


def _key(paths: Sequence[str], settings: dict[str, Any], stamp: "Callable[[str], str | None] | None" = None) -> str:
    import PIL
    import transformers

    digest = hashlib.sha256()
    digest.update(json.dumps({"version": CACHE_VERSION, "settings": settings, "pillow": PIL.__version__,
                              "transformers": transformers.__version__}, sort_keys=True).encode())
    for path in paths:
        stamped = stamp(path) if stamp is not None else None
        digest.update(f"\0{path}\0{stamped if stamped is not None else _file_stamp(path)}".encode())
    return digest.hexdigest()[:32]


def _file_stamp(path: str) -> str:
    try:
        stat = os.stat(path)
        size, mtime = stat.st_size, stat.st_mtime_ns
    except OSError:
        size = mtime = -1
    return f"{size}\0{mtime}"


def _index_file(file: Path) -> Path:
    return file.with_suffix(".json")


def _read_complete(file: Path, shape: tuple[int, ...]) -> dict[str, tuple[str, str | None]] | None:
    """The decode errors of a complete cache file of `shape`, or None when there is none to trust."""
    try:
        index = json.loads(_index_file(file).read_text())
        pixels = np.load(file, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if index.get("version") != CACHE_VERSION or tuple(pixels.shape) != shape or pixels.dtype != np.uint8:
        return None
    return {path: (message, source) for path, (message, source) in index["errors"].items()}


def _build(file: Path, paths: Sequence[str], processor: Any, shape: tuple[int, ...],
           load: "Callable[[str], Any] | None" = None) -> dict[str, tuple[str, str | None]]:
    """Decode, resize and crop every image once into `file`; the index first, the pixels renamed into place last
    (the mark of a complete cache)."""
    from vembed.data.images import load_image

    load_image = load or load_image
    start = time.perf_counter()
    _remove_stale(file)
    suffix = f".tmp-{socket.gethostname()}-{os.getpid()}"
    tmp = file.with_name(file.name + suffix)
    errors: dict[str, tuple[str, str | None]] = {}
    pixels = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
    try:
        for row, path in enumerate(paths):
            try:
                image = load_image(path)
            except DataError as err:
                errors[path] = (err.detail, err.file)
                continue
            out = processor(images=[image], do_rescale=False, do_normalize=False)["pixel_values"][0]
            pixels[row] = out
        pixels.flush()
        del pixels
        index = _index_file(file)
        index_tmp = index.with_name(index.name + suffix)
        index_tmp.write_text(json.dumps({"version": CACHE_VERSION, "shape": list(shape), "errors": errors}))
        os.replace(index_tmp, index)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info("image cache: %d images (%.1f MB) decoded and resized in %.1f s into %s", len(paths),
                np.prod(shape) / 1e6, time.perf_counter() - start, file)
    return errors


def _remove_stale(file: Path) -> None:
    """Temporary files of a build on this host whose process is gone (killed before its clean-up ran)."""
    host = socket.gethostname()
    for name in (file.name, _index_file(file).name):
        for stale in file.parent.glob(f"{name}.tmp-{host}-*"):
            pid = stale.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize
