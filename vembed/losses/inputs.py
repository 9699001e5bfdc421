"""What a loss needs of the training data (a score per pair, teacher score lists, hard negatives), checked against
the rows' checks before training so a mismatch is one line naming the key, not an error in the first step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.data.corpus import CorpusPairs
    from vembed.data.rows import PairRows
    from vembed.losses.base import EmbeddingLoss
    from vembed.recipe import Recipe


def check_loss_inputs(loss: "type[EmbeddingLoss]", recipe: "Recipe", rows: "PairRows | CorpusPairs") -> None:
    """`loss` (the recipe's loss class) against the training rows: hard negatives, and the score column's shape."""
    column = f"data.columns.score ({recipe.data.columns.score!r})"
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
    if needs is None or not len(rows):
        return
    none, numbers, lists = rows.score_shapes()
    if needs == "pair" and (none or lists):
        raise DataError(f"loss_type {recipe.loss_type} needs one number per pair in {column}; "
                        f"{none} records have no score and {lists} a list")
    if needs == "candidates" and (none or numbers):
        raise DataError(f"loss_type {recipe.loss_type} needs a list of teacher scores [positive, negatives...] per "
                        f"pair in {column}; {none} records have no score and {numbers} a single number")
    if needs == "candidates_or_margin":
        if none or (numbers and lists):
            raise DataError(f"loss_type {recipe.loss_type} needs in {column} either a teacher margin per pair (one "
                            f"hard negative) or a list of teacher scores [positive, negatives...] for every record; "
                            f"{none} have no score, {numbers} a number, {lists} a list")
        if numbers and negatives != 1:
            raise DataError(f"loss_type {recipe.loss_type}: a single score per pair is the teacher's margin over one "
                            f"hard negative, but the records keep {negatives}; set data.num_hard_negatives: 1 or give "
                            "lists of teacher scores")
