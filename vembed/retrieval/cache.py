"""Corpus embeddings kept on disk block by block, so that an interrupted encoding job resumes at the last complete
block and a finished one is reused (mining again with other thresholds re-encodes nothing).

A cache folder belongs to one model and one corpus: `manifest.json` records their fingerprint (`cache_key`), and a
folder whose manifest differs is emptied before use, so a retrained model or an edited corpus never meets stale
embeddings. Each file holds one process's share of one block under its corpus rows (`docs-<start>-<stop>.pt`),
written under a temporary name and renamed: a file that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.files import replace_atomically

if TYPE_CHECKING:
    from accelerate import Accelerator

MANIFEST = "manifest.json"
CACHE_FORMAT = 1  # bump when the block files change meaning
_HASH_CHUNK = 1 << 22


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(model_dir: str | os.PathLike) -> list[list[Any]]:
    """Every file of a saved model folder as (name, size, mtime in ns). Saving a model rewrites its files, so this
    changes with the weights without reading gigabytes of them (hashing a 7B model would take longer than a block)."""
    root = Path(model_dir)
    return [[str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(root.rglob("*")) if p.is_file()]


def cache_key(model_dir: str | os.PathLike, corpus_file: str | os.PathLike, **settings: Any) -> dict[str, Any]:
    """What embeddings in a cache folder depend on: the model folder's files, the corpus file's content (sha256: a
    copied or touched corpus stays valid, an edited one does not) and any `settings` that change the vectors."""
    corpus = Path(corpus_file)
    return {"format": CACHE_FORMAT, "model": str(Path(model_dir).resolve()),
            "model_files": model_fingerprint(model_dir), "corpus": str(corpus.resolve()),
            "corpus_size": corpus.stat().st_size, "corpus_sha256": file_sha256(corpus), **settings}


def check_cache_folder(folder: str | os.PathLike, key: str = "--cache-dir") -> None:
    """Refuse a folder holding block files under no manifest of ours: `open()` would delete them, and vembed did not
    write them (it writes the manifest before the first block). Every process checks, before any collective."""
    from vembed.errors import RecipeError

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RecipeError(key, f"{folder} is a file; name a folder for the embedding cache (or pass --no-cache)")
    if folder.is_dir() and not (folder / MANIFEST).is_file():
        foreign = sorted(path.name for path in folder.glob("docs-*.pt"))
        if foreign:
            raise RecipeError(key, f"{folder} holds {foreign[0]} and {len(foreign) - 1} more block file(s) without "
                                   f"vembed's {MANIFEST}; they would be deleted: choose another {key} or move them")


class EmbeddingCache:
    """Block embeddings under `folder` for the model and corpus `key` describes (`cache_key`).

    `open()` (every process calls it) checks the manifest on the main process and empties the folder of block files
    when it belongs to another model or corpus. `load`/`store` are what `document_blocks` calls per block share.
    """

    def __init__(self, folder: str | os.PathLike, key: dict[str, Any]):
        self.folder = Path(folder)
        self.key = json.loads(json.dumps(key))  # as it reads back from the manifest (tuples → lists)
        self.reused = 0
        self.stored = 0
        self.invalidated = False

    def open(self, accelerator: "Accelerator | None" = None) -> "EmbeddingCache":
        if accelerator is None or accelerator.is_main_process:
            self.folder.mkdir(parents=True, exist_ok=True)
            manifest = self.folder / MANIFEST
            try:
                current = json.loads(manifest.read_text())
            except (OSError, ValueError):
                current = None
            if current != self.key:
                self.invalidated = current is not None
                for stale in [*self.folder.glob("docs-*.pt"), *self.folder.glob("*.tmp")]:
                    stale.unlink()
                replace_atomically(manifest, lambda tmp: tmp.write_text(json.dumps(self.key, indent=1)))
        if accelerator is not None:
            accelerator.wait_for_everyone()
        return self

    def path(self, start: int, stop: int) -> Path:
        return self.folder / f"docs-{start:010d}-{stop:010d}.pt"

    def load(self, start: int, stop: int, stored: Any = None) -> Any:
        """The stored embeddings of corpus rows `[start, stop)`, or None when absent or unreadable. `stored`: the
        class of blocks kept as tensors by name (`from_state`; packed token vectors), None for a plain tensor."""
        path = self.path(start, stop)
        if not path.is_file():
            return None
        try:
            emb = torch.load(path, map_location="cpu", weights_only=True)
            if stored is not None:
                emb = stored.from_state(emb)
        except Exception:  # noqa: BLE001 - a damaged file is recomputed, whatever torch raises for it
            return None
        kind = torch.Tensor if stored is None else stored
        return emb if isinstance(emb, kind) and len(emb) == stop - start else None

    def store(self, start: int, stop: int, emb: Any) -> None:
        """`emb`: a tensor, or a block with `state()` (its tensors by name)."""
        saved = emb.state() if hasattr(emb, "state") else emb.detach().cpu().contiguous()
        replace_atomically(self.path(start, stop), lambda tmp: torch.save(saved, tmp))
        self.stored += 1
