"""A teacher's embeddings of the training rows, extracted once (`vembed extract --teacher MODEL --recipe RECIPE`), so
embedding distillation (loss_type embedding_mse) trains without the teacher in memory.

On disk: shards (`vembed.data.embedding_shards` names and writes them atomically) holding, per record, `embedding`
(n, d), `file` (an index into the index's `files`: absolute paths), `row` (the row's number in its file, as
`Example.row`) and `fingerprint` (a digest of the row's query text); `index.json` lists the shards, the teacher and
the size. A training row is matched to its vector by (file, row); its query text's fingerprint must be the one
extracted, so a teacher file made before the texts changed is refused rather than trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vembed.errors import DataError, RecipeError

if TYPE_CHECKING:
    from vembed.data.records import Example
    from vembed.data.rows import PairRows, TablePart

FORMAT = "vembed-teacher-embeddings/1"
KEY = "teacher_embeddings"  # the recipe key (the embedding_mse loss's) that names the folder
EXTRACT_HINT = "write it with `vembed extract --teacher MODEL --recipe RECIPE --out DIR`"


def fingerprint(text: str | None) -> int:
    """A stable 64-bit digest of a query text (not Python's salted `hash`: it must agree across processes and runs)."""
    digest = hashlib.blake2b((text or "").encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def query_texts(part: "TablePart") -> list[str | None]:
    """The raw query cell of every kept row of `part` (no source prompt: the teacher embeds the text as written)."""
    from vembed.data.reader import side_text

    texts = []
    for position in part.rows:
        value = part._row(int(position)).get("query")
        try:
            texts.append(side_text(value, "query"))
        except Exception:  # noqa: BLE001 - a non-text cell was skipped by the checks; it has no fingerprint
            texts.append(None)
    return texts


def record_keys(rows: "PairRows") -> tuple[list[str], np.ndarray, np.ndarray, list[str | None]]:
    """(files, file index per record, row number per record, query text per record), in the records' order."""
    files: list[str] = []
    file_ids, numbers, texts = [], [], []
    for part in rows.parts:
        path = os.path.abspath(part.reader.file)
        if path not in files:
            files.append(path)
        file_ids.append(np.full(len(part.rows), files.index(path), dtype=np.int64))
        numbers.append(np.asarray(part.rows, dtype=np.int64) + 1)  # Example.row: the position in the file, from 1
        texts += query_texts(part)
    empty = np.zeros(0, dtype=np.int64)
    return files, np.concatenate(file_ids or [empty]), np.concatenate(numbers or [empty]), texts


def write_index(directory: Path, info: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    from vembed.data.embedding_shards import INDEX_FILE
    from vembed.files import replace_atomically

    index = {"format": FORMAT, **info, "num_rows": sum(s["count"] for s in shards), "shards": shards}
    replace_atomically(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=1)))
    return index


def read_index(folder: str | os.PathLike) -> dict[str, Any]:
    """The index of a teacher-embeddings folder; a missing or foreign one is a RecipeError naming the key."""
    from vembed.data.embedding_shards import INDEX_FILE

    path = Path(folder) / INDEX_FILE
    if not path.is_file():
        raise RecipeError(KEY, f"{str(folder)!r} holds no teacher embeddings (no {INDEX_FILE}); {EXTRACT_HINT}")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"not readable as JSON: {err}", file=str(path)) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise RecipeError(KEY, f"{str(folder)!r} is not a folder of teacher embeddings ({FORMAT}); {EXTRACT_HINT}")
    return index


class TeacherEmbeddings:
    """Every vector of a teacher-embeddings folder in memory (float32), looked up by (file, row).

    `check_rows(rows)` refuses training rows without a vector or whose query text changed since extraction;
    `lookup(examples)` gives the (B, d) teacher vectors of a batch (the collator calls it, in DataLoader workers).
    """

    def __init__(self, folder: str | os.PathLike):
        from safetensors.torch import load_file

        self.folder = str(folder)
        self.index = read_index(folder)
        self.files: list[str] = list(self.index["files"])
        self.dim = int(self.index["dim"])
        parts: dict[str, list[torch.Tensor]] = {"embedding": [], "file": [], "row": [], "fingerprint": []}
        for shard in self.index["shards"]:
            path = Path(folder) / shard["file"]
            try:
                tensors = load_file(str(path))
            except Exception as err:  # noqa: BLE001 - a missing or truncated file, whatever safetensors calls it
                raise DataError(f"teacher shard unreadable ({type(err).__name__}); re-run `vembed extract`",
                                file=str(path)) from None
            for name in parts:
                parts[name].append(tensors[name])
        embedding = torch.cat(parts["embedding"]) if parts["embedding"] else torch.zeros(0, self.dim)
        self.embedding = embedding.float()
        file_ids = torch.cat(parts["file"]).numpy() if parts["file"] else np.zeros(0, np.int64)
        numbers = torch.cat(parts["row"]).numpy() if parts["row"] else np.zeros(0, np.int64)
        self.fingerprints = torch.cat(parts["fingerprint"]).numpy() if parts["fingerprint"] else np.zeros(0, np.int64)
        # Per file: its row numbers sorted, and where each sits in `embedding` (looked up with searchsorted).
        self._by_file: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for number, path in enumerate(self.files):
            where = np.flatnonzero(file_ids == number)
            order = np.argsort(numbers[where], kind="stable")
            self._by_file[path] = (numbers[where][order], where[order])

    def positions(self, file: str, numbers: np.ndarray) -> np.ndarray:
        """Where each row `numbers` of `file` has its vector; -1 where the folder has none."""
        result = np.full(len(numbers), -1, dtype=np.int64)
        found = self._by_file.get(os.path.abspath(file))
        if found is None or not len(found[0]):
            return result
        sorted_rows, where = found
        at = np.searchsorted(sorted_rows, numbers).clip(max=len(sorted_rows) - 1)
        hit = sorted_rows[at] == numbers
        result[hit] = where[at[hit]]
        return result

    def check_rows(self, rows: "PairRows") -> None:
        """Every training record has a vector here, extracted from the same query text; a DataError otherwise."""
        files, file_ids, numbers, texts = record_keys(rows)
        found = np.full(len(texts), -1, dtype=np.int64)
        for i, path in enumerate(files):
            mine = file_ids == i
            found[mine] = self.positions(path, numbers[mine])
        missing = np.flatnonzero(found < 0)
        if len(missing):
            first = int(missing[0])
            raise DataError(f"{self.folder} ({KEY}) has no teacher embedding for {len(missing)} of the {len(texts)} "
                            f"training rows (first: this row); the teacher file was extracted from other data: "
                            f"re-run `vembed extract` on this recipe", file=files[file_ids[first]],
                            row=int(numbers[first]))
        expected = np.fromiter((fingerprint(text) for text in texts), dtype=np.int64, count=len(texts))
        stale = np.flatnonzero(self.fingerprints[found] != expected)
        if len(stale):
            first = int(stale[0])
            raise DataError(f"the query text of {len(stale)} training rows changed since {self.folder} ({KEY}) was "
                            f"extracted (first: this row): the teacher file is stale; re-run `vembed extract`",
                            file=files[file_ids[first]], row=int(numbers[first]))

    def lookup(self, examples: "list[Example]") -> torch.Tensor:
        """The (B, d) float32 teacher vectors of a batch's records (matched by their file and row)."""
        at = [int(self.positions(example.source or "", np.asarray([example.row or 0]))[0]) for example in examples]
        if min(at) < 0:
            odd = examples[at.index(min(at))]
            raise DataError(f"no teacher embedding for this row in {self.folder} ({KEY})", file=odd.source,
                            row=odd.row)
        return self.embedding[at]


__all__ = ["FORMAT", "KEY", "TeacherEmbeddings", "fingerprint", "query_texts", "read_index", "record_keys"]
