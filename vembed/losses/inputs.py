"""What a loss needs of the training data (a score per pair, teacher score lists, hard negatives), checked against
the rows' checks before training so a mismatch is one line naming the key, and the file and row of the first record
that lacks it, not an error in the first step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.data.corpus import CorpusPairs
    from vembed.data.records import Example
    from vembed.data.rows import PairRows
    from vembed.losses.base import EmbeddingLoss
    from vembed.recipe import Recipe

HAS = {"none": "has no score", "number": "has one number", "list": "has a list of teacher scores"}  # SCORE_SHAPES
# The score shapes each `needs_scores` refuses, as check_loss_inputs refuses them in rows read whole.
REFUSED_SHAPES = {"pair": ("none", "list"), "candidates": ("none", "number"), "candidates_or_margin": ("none",)}
NEEDS = {"pair": "needs one number per pair",
         "candidates": "needs a list of teacher scores [positive, negatives...] per pair",
         "candidates_or_margin": "needs a teacher margin (one number) or a list of teacher scores per pair"}


def check_loss_inputs(loss: "type[EmbeddingLoss]", recipe: "Recipe", rows: "PairRows | CorpusPairs") -> None:
    """`loss` (the recipe's loss class) against the training rows: hard negatives, and the score column's shape."""
    negatives = min(rows.negative_counts(), default=0)
    if negatives < loss.min_negatives:
        raise DataError(f"loss_type {recipe.loss_type} needs at least {loss.min_negatives} hard negative per pair; "
                        f"the training records keep {negatives} (data.columns.negatives, data.num_hard_negatives)")
    if loss.needs_labels:
        unlabelled, first = rows.unlabelled_records()
        if unlabelled:
            example = rows[first]
            raise DataError(f"loss_type {recipe.loss_type} mines on labels, but {unlabelled} of {len(rows)} training "
                            f"records have none in data.columns.label ({recipe.data.columns.label!r}); give every "
                            "row a label, or map data.columns.label to the column that holds them",
                            file=example.source, row=example.row)
    needs = loss.needs_scores
    if needs is None:
        return
    none, numbers, lists = rows.score_shapes()
    counts = {"none": none, "number": numbers, "list": lists}
    name = recipe.loss_type
    if needs == "pair":
        _refuse(rows, REFUSED_SHAPES[needs], counts, f"loss_type {name} {NEEDS[needs]}")
    if needs == "candidates":
        _refuse(rows, REFUSED_SHAPES[needs], counts, f"loss_type {name} {NEEDS[needs]}")
    if needs == "candidates_or_margin":
        rarer = ("number",) if numbers <= lists else ("list",)  # mixed: the odd ones out are named
        _refuse(rows, ("none",) + (rarer if numbers and lists else ()), counts,
                f"loss_type {name} needs either a teacher margin per pair (one hard negative) or a list of teacher "
                f"scores [positive, negatives...] for every record; {none} have no score, {numbers} a number, "
                f"{lists} a list")
        if numbers and negatives != 1:
            raise DataError(f"loss_type {name}: a single score per pair is the teacher's margin over one "
                            f"hard negative, but the records keep {negatives}; set data.num_hard_negatives: 1 or give "
                            "lists of teacher scores")


def record_lacks(loss: "type[EmbeddingLoss]", loss_type: str) -> "Callable[[Example], tuple[str, str] | None]":
    """For a streamed sample, which no check reads beforehand: a function giving (skip reason, why) when one record
    lacks what `loss` reads (its label, a score of the shape it needs), in check_loss_inputs' words; else None."""
    refused = REFUSED_SHAPES.get(loss.needs_scores or "", ())
    needs_label = loss.needs_labels

    def lacks(example: "Example") -> tuple[str, str] | None:
        if needs_label and example.label is None:
            return "missing_label", f"has no label (data.columns.label); loss_type {loss_type} mines on labels"
        shape = score_shape(example.score)
        if shape in refused:
            return "bad_score", f"data.columns.score {HAS[shape]}; loss_type {loss_type} {NEEDS[loss.needs_scores]}"
        return None

    return lacks


def required_parts(loss: "type[EmbeddingLoss]", loss_type: str) -> dict[str, str]:
    """The record parts (data.columns keys) `loss` reads, each with why: what a stream's first sample must have."""
    parts = {"label": f"loss_type {loss_type} mines on labels"} if loss.needs_labels else {}
    if loss.needs_scores:
        parts["score"] = f"loss_type {loss_type} {NEEDS[loss.needs_scores]}"
    return parts


def score_shape(score: float | list[float] | None) -> str:
    """A record's score as one of SCORE_SHAPES' names."""
    return "none" if score is None else "list" if isinstance(score, list) else "number"


def _refuse(rows: "PairRows | CorpusPairs", shapes: tuple[str, ...], counts: dict[str, int], needs: str) -> None:
    """A `DataError` naming the file and row of the first record whose score is of one of `shapes` (a missing
    score first), or the file when it has no score column; nothing when no record's is."""
    for shape in shapes:
        place = rows.first_score(shape)
        if place is None:
            continue
        if place.row is None:
            column = f"column {place.column!r}" if place.column else "score column"
            raise DataError(f"has no {column} (data.columns.score); {needs}: give the file one, or map yours with "
                            "data.columns.score=<column>", file=place.file)
        count = counts[shape]
        raise DataError(f"data.columns.score ({place.column!r}) {HAS[shape]}; {needs} ({count} such "
                        f"record{'s' if count != 1 else ''})", file=place.file, row=place.row)
