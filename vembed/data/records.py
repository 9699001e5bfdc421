"""The record types (`Example`, `Side`): what every row of every data source becomes and every adapter consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from PIL import Image

ImageLike = Union[str, "Image.Image"]  # a file path (resolved, absolute) or a decoded RGB image


@dataclass
class Side:
    """One item to embed: text, an image, or both (the adapter decides how it fuses both)."""

    text: str | None = None
    image: ImageLike | list[ImageLike] | None = None  # a list: several images (qwen_vl; other adapters take one)
    # "query" or "document" (positives and hard negatives); None when unknown (e.g. the Python API). Adapters with
    # per-side instructions (qwen_vl) read it; others ignore it.
    role: str | None = None
    # The instruction this side is embedded with, by adapters that take one (qwen_vl's system turn); None: the
    # adapter's own for the role. Set per named source (data.train.<name>.query_instruction).
    instruction: str | None = None

    @property
    def images(self) -> list[ImageLike]:
        """This side's images as a list: none, one, or several."""
        if self.image is None:
            return []
        return list(self.image) if isinstance(self.image, (list, tuple)) else [self.image]

    @property
    def is_empty(self) -> bool:
        return not (self.text and self.text.strip()) and self.image is None


@dataclass
class Example:
    """A training/evaluation record: a query, its positive, optional hard negatives and an optional group label."""

    query: Side
    positive: Side
    negatives: list[Side] = field(default_factory=list)
    label: str | None = None  # items sharing a label are relevant to each other in evaluation
    # data.columns.score: a gold score of the pair, or teacher scores of [positive, negatives...]; None: no score
    score: float | list[float] | None = None
    row: int | None = None  # row in the source file, for error messages
    source: str | None = None  # source file, for error messages
    source_name: str | None = None  # the named source (data.train: {name: ...}) it came from; None: unnamed

    def keep_negatives(self, count: int) -> None:
        """Keep the first `count` hard negatives, and a list of teacher scores ([positive, negatives...]) cut with
        them."""
        del self.negatives[count:]
        if isinstance(self.score, list):
            del self.score[1 + count:]
