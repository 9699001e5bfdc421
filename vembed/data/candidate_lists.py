"""The candidate-list shape of a pairs file, one line per query with its ranked candidates and a teacher's scores of
them, read as pairs: `{"query": ..., "documents": [d0, d1, ...], "scores": [s0, s1, ...]}` becomes positive = d0,
negatives = [d1, ...], score = [s0, s1, ...] (what distill_kl, late_interaction_distill_kl and margin_mse read).

Applied once, to the table as it is opened (`vembed.data.tables.open_table`), so the row checks, the records, the
image and duplicate lookups all see an ordinary pairs table. A file has this shape when it has the
data.columns.documents column and no positive column; the scores are data.columns.score where the file has that
column, else `scores`. Documents are texts.
"""

from __future__ import annotations

from typing import Any

from vembed.data.reader import as_list
from vembed.errors import DataError

SCORES = "scores"  # the shape's score column, read when the file has no data.columns.score column


def is_candidate_lists(present: list[str], columns: dict[str, str]) -> bool:
    return columns["documents"] in present and columns["positive"] not in present \
        and columns["positive_image"] not in present


def as_pairs(table: Any, file: str, builder: str, columns: dict[str, str]) -> Any:
    """`table` (a `datasets.Dataset` or `JsonRows`) with its documents column split into positive and negatives and
    its score column under data.columns.score; unchanged when it is not of this shape. A score list whose length is
    not the documents list's is a `DataError` naming the row (the scores would be matched to the wrong documents)."""
    present = list(table.column_names)
    if not is_candidate_lists(present, columns):
        return table
    documents = columns["documents"]
    if columns["negatives"] in present:
        raise DataError(f"has both a {documents!r} column (data.columns.documents: the positive, then the hard "
                        f"negatives) and a {columns['negatives']!r} column (data.columns.negatives); give one of them",
                        file=file)
    score = columns["score"] if columns["score"] in present else SCORES if SCORES in present else None
    split = _Splitter(file, builder, documents, score, columns)
    if hasattr(table, "records"):  # vembed.data.tables.JsonRows (the records rebuilt as the same type)
        batch = {name: [record.get(name) for record in table.records] for name in present}
        pairs = split(batch, list(range(table.num_rows)))
        names = [name for name in present if name not in (documents, score)] + list(pairs)
        batch.update(pairs)
        return type(table)([dict(zip(names, values)) for values in zip(*(batch[name] for name in names))], names)
    return table.map(split, batched=True, with_indices=True, remove_columns=[documents] + ([score] if score else []),
                     features=_features(table, documents, score, columns),
                     desc=f"reading the documents lists of {file}")


class _Splitter:
    """Picklable batch function (`Dataset.map` may hash it for its cache): a batch of rows' columns -> the positive,
    negatives and score columns."""

    def __init__(self, file: str, builder: str, documents: str, score: str | None, columns: dict[str, str]):
        self.file, self.builder, self.documents, self.score = file, builder, documents, score
        self.positive, self.negatives, self.score_column = columns["positive"], columns["negatives"], columns["score"]

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        positives, negatives = [], []
        scores = batch[self.score] if self.score else [None] * len(indices)
        for index, cell, score in zip(indices, batch[self.documents], scores):
            documents = as_list(cell, self.builder)
            listed = isinstance(score, (list, tuple)) or (self.builder == "csv" and isinstance(score, str)
                                                           and score.lstrip().startswith("["))  # as score_of reads
            given = as_list(score, self.builder) if listed else None
            if given is not None and len(given) != len(documents):
                raise DataError(f"data.columns.score ({self.score!r}): {len(given)} teacher scores for "
                                f"{len(documents)} documents (data.columns.documents {self.documents!r}); give one "
                                "score per document, in order", file=self.file, row=index + 1)
            positives.append(documents[0] if documents else None)
            negatives.append(documents[1:])
        pairs = {self.positive: positives, self.negatives: negatives}
        if self.score:
            pairs[self.score_column] = list(scores)
        return pairs


def _features(table: Any, documents: str, score: str | None, columns: dict[str, str]) -> Any:
    """The mapped table's column types, fixed (a batch whose rows have no negatives would otherwise infer a list of
    nulls): the documents' item type for the positive and the negatives, the score column's own type."""
    import datasets

    features = {name: feature for name, feature in table.features.items() if name not in (documents, score)}
    item = getattr(table.features[documents], "feature", datasets.Value("string"))
    features[columns["positive"]] = item
    features[columns["negatives"]] = datasets.List(item)
    if score:
        features[columns["score"]] = table.features[score]
    return datasets.Features(features)
