"""Runs as files: the TREC run format (`query-id Q0 doc-id rank score tag`, what trec_eval, pyserini, BEIR and ranx
read and write) and a JSONL form with the texts, so a ranking leaves vembed and comes back as a file.

A run in memory is `{query_id: {doc_id: score}}`. Its order is trec_eval's (score descending, equal scores by
document id descending: `vembed.evaluation.corpus.rankings_from_run`), and the rank column is written in that order,
so every tool reading the file ranks as vembed measured.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from vembed.errors import DataError
from vembed.files import replace_atomically

if TYPE_CHECKING:
    from vembed.data.corpus import CorpusSplit

Run = dict[str, dict[str, float]]
FORMATS = ("trec", "jsonl")
TREC_LINE = "query-id Q0 doc-id rank score tag"


def read_run(path: str | os.PathLike) -> Run:
    """A TREC run file as `{query_id: {doc_id: score}}`. A line that is not 6 fields with a numeric, finite score,
    a document listed twice for one query, and a file without any line are DataErrors naming the file (and line)."""
    import math

    run: Run = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields:
                continue
            try:
                if len(fields) != 6:
                    raise ValueError
                query, _, document, _, score, _ = fields
                value = float(score)
            except ValueError:
                raise DataError(f"is not a TREC run line ({TREC_LINE})", str(path), number) from None
            if not math.isfinite(value):
                raise DataError(f"score {score!r} is not a finite number", str(path), number)
            if document in run.setdefault(query, {}):
                raise DataError(f"document {document!r} is listed twice for query {query!r}", str(path), number)
            run[query][document] = value
    if not run:
        raise DataError(f"holds no run line ({TREC_LINE})", str(path))
    return run


def ranked(run: Mapping[str, Mapping[str, float]], depth: int | None = None) -> dict[str, list[tuple[str, float]]]:
    """Each query's (doc_id, score), best first in trec_eval's order, cut to `depth` (None: all)."""
    from vembed.evaluation.corpus import rankings_from_run

    return {query: [(doc, float(run[query][doc])) for doc in ranking[:depth]]
            for query, ranking in rankings_from_run(run).items()}


def cut(run: Mapping[str, Mapping[str, float]], depth: int) -> Run:
    """Each query's top `depth` documents with their scores."""
    return {query: dict(hits) for query, hits in ranked(run, depth).items()}


def write_run(path: str | os.PathLike, run: Mapping[str, Mapping[str, float]], *, tag: str = "vembed",
              format: str = "trec", split: "CorpusSplit | None" = None) -> Path:
    """`run` at `path`, whole or not at all (written beside it, then renamed). `format` "trec": six columns;
    "jsonl": one row per (query, document) with `query_id, doc_id, rank, score` and, given the `split`, the query's
    and the document's text."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if any(char.isspace() for char in tag) or not tag:
        raise ValueError(f"a run tag is one word, got {tag!r}")
    lines = list(_trec_lines(run, tag) if format == "trec" else _jsonl_lines(run, split))

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.writelines(line + "\n" for line in lines)

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return replace_atomically(path, write)


def _trec_lines(run: Mapping[str, Mapping[str, float]], tag: str) -> Iterable[str]:
    for query, hits in ranked(run).items():
        for rank, (doc, score) in enumerate(hits, start=1):
            yield f"{query} Q0 {doc} {rank} {score!r} {tag}"


def _jsonl_lines(run: Mapping[str, Mapping[str, float]], split: "CorpusSplit | None") -> Iterable[str]:
    for query, hits in ranked(run).items():
        query_text = _text(split.queries, query) if split is not None else None
        for rank, (doc, score) in enumerate(hits, start=1):
            row = {"query_id": query, "doc_id": doc, "rank": rank, "score": score}
            if split is not None:
                row.update(query=query_text, document=_text(split.corpus, doc))
            yield json.dumps(row, ensure_ascii=False)


def _text(items, item_id: str) -> str | None:
    """An item's text, or its image's path for an image item (the JSONL row stays JSON)."""
    side = items.sides[items.index[item_id]] if item_id in items.index else None
    if side is None:
        return None
    return side.text if side.text is not None else ", ".join(str(image) for image in side.images) or None


def check_documents_in_corpus(run: Mapping[str, Mapping[str, float]], split: "CorpusSplit",
                              path: str | os.PathLike) -> None:
    """Every document the run names is in the corpus: one DataError naming the first that is not (a run of another
    corpus, or of another version of this one)."""
    for query, hits in run.items():
        missing = next((doc for doc in hits if doc not in split.corpus.index), None)
        if missing is not None:
            raise DataError(f"document {missing!r} (query {query!r}) is not in {split.folder}/corpus.jsonl; was the "
                            "run made on another corpus?", str(path))


__all__ = ["FORMATS", "Run", "check_documents_in_corpus", "cut", "ranked", "read_run", "write_run"]
