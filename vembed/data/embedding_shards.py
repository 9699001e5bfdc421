"""Paired teacher embeddings on disk: shards of safetensors plus a JSON index, and the dataset that reads them.

A shard directory (written by `vembed extract`) holds `shard-00000.safetensors`, ... each with two tensors,
`eva` (n, M, eva_dim) from teacher A and `clip` (n, N, clip_dim) from teacher B, and in its metadata the image
sources and the images it skipped. `index.json` lists the shards with their counts, the token shapes, dtypes, the
teachers and totals. A shard file appears under its final name only once complete (written, then renamed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from vembed.errors import DataError, RecipeError

INDEX_FILE = "index.json"
FORMAT = "vembed-embedding-shards/1"
SIDES = ("eva", "clip")  # teacher A (condition), teacher B (target)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(path: Path, eva: torch.Tensor, clip: torch.Tensor, sources: list[str], skipped: list[str],
                writer_rank: int) -> None:
    """Write one shard atomically: a temporary name, renamed when complete (so a killed run leaves no half shard)."""
    metadata = {"sources": json.dumps(sources), "skipped": json.dumps(skipped), "rank": str(writer_rank)}
    write_tensors(path, {"eva": eva, "clip": clip}, metadata)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors shard written under a temporary name and renamed when complete: a killed run leaves no half
    shard under the final name (what resuming relies on). Text teachers' shards are written here too
    (vembed/data/teacher_embeddings.py)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".tmp-{path.name}")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(tmp), metadata=metadata)
    tmp.replace(path)


def read_shard_metadata(path: Path) -> dict[str, Any]:
    """Shapes, dtypes and metadata of a shard, from its header only (no tensor data is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return {"shapes": shapes, "dtypes": dtypes, "sources": json.loads(meta.get("sources", "[]")),
            "skipped": json.loads(meta.get("skipped", "[]")), "rank": int(meta.get("rank", "0"))}


def write_index(directory: Path, shard_files: list[Path], info: dict[str, Any]) -> dict[str, Any]:
    """Collect the shards' headers into `index.json` (atomically); returns the index."""
    shards, total, skipped, shapes, dtypes = [], 0, 0, None, None
    for path in shard_files:
        meta = read_shard_metadata(path)
        count = meta["shapes"]["eva"][0]
        shards.append({"file": path.name, "count": count, "skipped": len(meta["skipped"]), "rank": meta["rank"]})
        total += count
        skipped += len(meta["skipped"])
        if count:
            shapes = shapes or {side: meta["shapes"][side][1:] for side in SIDES}
            dtypes = dtypes or meta["dtypes"]
    index = {"format": FORMAT, **info, "num_samples": total, "num_skipped_images": skipped,
             "eva_shape": (shapes or {}).get("eva"), "clip_shape": (shapes or {}).get("clip"),
             "dtypes": dtypes, "shards": shards}
    tmp = directory / f".tmp-{INDEX_FILE}"
    tmp.write_text(json.dumps(index, indent=2))
    tmp.replace(directory / INDEX_FILE)
    return index


def read_index(directory: str | list[str] | None, key: str = "data.train") -> dict[str, Any]:
    """The index of a shard directory, with `path` (the index file) added; a missing or foreign one is a
    RecipeError naming `key`."""
    if directory is None:
        raise RecipeError(key, "is required: point it at a directory written by `vembed extract`")
    if isinstance(directory, list):
        if len(directory) != 1:
            raise RecipeError(key, f"give one shard directory, not {len(directory)}")
        directory = directory[0]
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        raise RecipeError(key, f"{str(directory)!r} is not a shard directory (no {INDEX_FILE}); write one with "
                               "`vembed extract --out DIR`")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"not valid JSON ({err.msg} at line {err.lineno})", file=str(path)) from None
    if index.get("format") != FORMAT or not index.get("eva_shape") or not index.get("clip_shape"):
        raise DataError(f"not a {FORMAT} index with samples; re-run `vembed extract`", file=str(path))
    return {**index, "path": str(path)}


@dataclass
class ShardReport:
    """What the dataset could use: samples kept, shards skipped as unreadable (and why)."""

    directory: str
    num_samples: int = 0
    num_shards: int = 0
    bad_shards: list[dict[str, str]] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.bad_shards)

    def summary(self) -> str:
        text = f"{self.num_samples} samples from {self.num_shards} shard(s) in {self.directory}"
        if self.bad_shards:
            first = self.bad_shards[0]
            text += f"; skipped {len(self.bad_shards)} unreadable shard(s), first {first['file']}: {first['reason']}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "num_samples": self.num_samples, "num_shards": self.num_shards,
                "bad_shards": self.bad_shards}


class EmbeddingShardDataset(Dataset):
    """Map-style dataset of `{"eva": (M, eva_dim), "clip": (N, clip_dim)}` float32 pairs from a shard directory.

    Rows are read lazily through safetensors' memory map (one open file per shard and process), so the data set
    may be larger than memory. Shards whose header is unreadable or disagrees with the index are skipped and
    counted; above `max_bad_fraction` of the shards, it stops. Shuffling and the split across ranks are the
    loop's sampler's job (the same per-epoch permutation on every rank, disjoint batches per rank).
    """

    def __init__(self, directory: str | list[str], *, max_bad_fraction: float = 0.05, key: str = "data.train"):
        self.index = read_index(directory, key)
        self.directory = Path(self.index["path"]).parent
        self.report = ShardReport(str(self.directory))
        self.files: list[Path] = []
        self.offsets: list[int] = [0]
        for entry in self.index["shards"]:
            if not entry["count"]:
                continue
            path = self.directory / entry["file"]
            reason = self._check(path, entry["count"])
            if reason:
                self.report.bad_shards.append({"file": entry["file"], "reason": reason})
                continue
            self.files.append(path)
            self.offsets.append(self.offsets[-1] + entry["count"])
        self.report.num_shards = len(self.files)
        self.report.num_samples = self.offsets[-1]
        listed = sum(1 for e in self.index["shards"] if e["count"])
        if listed and self.report.num_skipped / listed > max_bad_fraction:
            raise DataError(f"{self.report.num_skipped} of {listed} shards are unreadable (more than "
                            f"data.max_bad_fraction={max_bad_fraction}); first: {self.report.bad_shards[0]}",
                            file=self.index["path"])
        self._handles: dict[int, Any] = {}

    def _check(self, path: Path, count: int) -> str | None:
        try:
            meta = read_shard_metadata(path)
        except Exception as err:  # a missing or truncated file, whatever safetensors calls it
            return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'unreadable'}"
        for side in SIDES:
            expected = [count, *self.index[f"{side}_shape"]]
            if meta["shapes"].get(side) != expected:
                return f"{side} has shape {meta['shapes'].get(side)}, the index says {expected}"
        return None

    def __len__(self) -> int:
        return self.offsets[-1]

    def _handle(self, shard: int):
        from safetensors import safe_open

        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.files[shard]), framework="pt")
        return self._handles[shard]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import bisect

        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = bisect.bisect_right(self.offsets, i) - 1
        row = i - self.offsets[shard]
        handle = self._handle(shard)
        return {side: handle.get_slice(side)[row : row + 1][0].float() for side in SIDES}

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen their own handles
        return {**self.__dict__, "_handles": {}}

    def tensors(self, limit: int | None = None) -> dict[str, torch.Tensor]:
        """The first `limit` samples (all when None) stacked: `{"eva": (n, M, De), "clip": (n, N, Dc)}`."""
        n = len(self) if limit is None else min(limit, len(self))
        items = [self[i] for i in range(n)]
        return {side: torch.stack([item[side] for item in items]) if items else torch.empty(0) for side in SIDES}
