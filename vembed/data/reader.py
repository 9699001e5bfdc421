"""One table row -> one `Example`: which cell is which part, image paths resolved, empty cells recognised.

The same rules serve the vectorised checks of a whole table (`vembed/data/checks.py`, which counts what would be
skipped) and the records built one at a time on fetch (`vembed/data/rows.py`), so both agree on every row.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from vembed.data.records import Example, ImageLike, Side

# Why a row was skipped, and what the user can do about it (used in the error when too many are).
SKIP_FIXES = {
    "empty_query": "give every row a query text or image",
    "empty_positive": "give every row a positive text or image",
    "missing_image": "check the image paths and data.image_root",
    "bad_image": "give image columns file paths (or a datasets Image feature)",
    "bad_text": "give query/positive/negatives text (a column of numbers only is read as numbers: check that "
                "data.columns maps the text columns)",
    "too_few_negatives": "lower data.num_hard_negatives or add negatives to those rows",
    "bad_score": "give data.columns.score numbers (or lists of numbers), or map it to the score column",
}

PARTS = ("query", "query_image", "positive", "positive_image", "negatives", "negative_images", "label", "score")


class UnusableImage(Exception):
    """Raised while reading a row whose image (or text) cell cannot be used; the row is skipped under `reason`."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


class Skipped(Exception):
    """A row that cannot become a record: `reason` is a key of SKIP_FIXES."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def row_number(position: int) -> int:
    """The row every data message names for the table row at `position` (0-based): data rows counted from 1 in file
    order, so a CSV's header line is not a row (row 1 is the line under it), nor is a blank line of a JSON Lines
    file."""
    return int(position) + 1


def is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def text_of(value: Any) -> str | None:
    """A cell as text, or None when it is empty (null, NaN, blank)."""
    if is_null(value):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # CSV integer columns with gaps are read as floats: label 7.0 means "7"
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def side_text(value: Any, part: str) -> str | None:
    """A text cell of a query, positive or negative: a string, or None when empty. A number or a list there is a wrong
    column or a wrongly typed file, not text to embed (str() would train on "12" or "['a', 'b']"): `bad_text`."""
    if is_null(value):
        return None
    if not isinstance(value, str):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UnusableImage("bad_text", f"{part} cell holds {type(value).__name__} {shown}, not text")
    return value if value.strip() else None


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UnusableImage("bad_score", f"score cell holds {type(value).__name__} {shown}, not a number")
    return float(value)


def score_of(value: Any, builder: str) -> float | list[float] | None:
    """A score cell: a number, a list of numbers (a CSV cell may hold one as JSON), or None when empty; anything
    else (text, a list holding text) is `bad_score`. A NaN inside a list is bad too: a teacher score is missing."""
    if is_null(value):
        return None
    if isinstance(value, (list, tuple)) or (builder == "csv" and isinstance(value, str)
                                           and value.lstrip().startswith("[")):
        numbers = [_number(item) for item in as_list(value, builder)]
        if any(math.isnan(number) for number in numbers):
            raise UnusableImage("bad_score", f"score list {value!r} holds NaN")
        return numbers
    return _number(value)


def as_list(value: Any, builder: str) -> list[Any]:
    if is_null(value):
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if builder == "csv" and isinstance(value, str) and value.lstrip().startswith("["):
        try:  # a CSV cell cannot hold a list; accept one written as JSON
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
    return [value]


@dataclass
class SourceSettings:
    """What a named source adds to each of its records (see `SourceConfig` in vembed/recipe.py)."""

    name: str | None = None
    query_prompt: str | None = None
    query_instruction: str | None = None


class RowReader:
    """Turns the rows of one table into Examples; knows its file, column map, image base directory and source."""

    def __init__(self, file: str, builder: str, columns: dict[str, str], image_base: str,
                 source: SourceSettings | None = None, json_parts: frozenset[str] = frozenset()):
        self.file, self.builder, self.columns, self.image_base = file, builder, columns, image_base
        self.source = source or SourceSettings()
        # Parts whose column `datasets` stores as JSON text (its `Json` feature: cells of mixed types, e.g. a list in
        # one row and a string in the next); their cells are decoded before use.
        self.json_parts = json_parts

    def cell(self, part: str, value: Any) -> Any:
        """A stored cell as the row holds it (JSON-stored columns decoded)."""
        if part in self.json_parts and isinstance(value, str):
            return json.loads(value)
        return value

    def image(self, value: Any) -> ImageLike | None:
        if is_null(value):
            return None
        if isinstance(value, dict):  # a datasets Image feature: {"path", "bytes"}
            if value.get("bytes"):
                from PIL import Image

                try:  # opened lazily: only the compressed bytes are held until the record is fetched
                    return Image.open(io.BytesIO(value["bytes"]))
                except Exception as err:  # noqa: BLE001 - PIL raises several types for bad data
                    raise UnusableImage("bad_image", f"embedded image is not readable: {err}") from None
            value = value.get("path")
            if not value:
                return None
        if not isinstance(value, str):
            from PIL import Image

            if isinstance(value, Image.Image):
                return value
            raise UnusableImage("bad_image", f"image cell holds {type(value).__name__} {value!r}, not a path")
        if not value.strip():
            return None
        path = os.path.expanduser(value)
        if not os.path.isabs(path):
            path = os.path.join(self.image_base, path)
        path = os.path.normpath(path)
        if not os.path.isfile(path):
            raise UnusableImage("missing_image", f"image {path!r} not found")
        return path

    def side_images(self, value: Any) -> ImageLike | list[ImageLike] | None:
        """One side's image cell: a path (or embedded image), or a list of them (several images per sample, e.g. a
        JSON list, a parquet list column, a datasets List(Image), or a CSV cell holding a JSON list). A list of one is
        that one image, so single-image adapters read it too."""
        images = [image for image in map(self.image, as_list(value, self.builder)) if image is not None]
        if not images:
            return None
        return images[0] if len(images) == 1 else images

    def example(self, row: dict[str, Any], number: int) -> Example:
        """The record of one row (keyed by part: query, positive_image, ...), numbered from 1 in its file; raises
        `Skipped` for a row that cannot be one."""
        get = row.get
        try:
            query = Side(side_text(get("query"), "query"), self.side_images(get("query_image")), role="query")
            positive = Side(side_text(get("positive"), "positive"), self.side_images(get("positive_image")),
                            role="document")
            if query.is_empty:
                raise Skipped("empty_query", "no query text or image")
            if positive.is_empty:
                raise Skipped("empty_positive", "no positive text or image")
            texts = as_list(get("negatives"), self.builder)
            images = as_list(get("negative_images"), self.builder)
            negatives = [Side(side_text(t, "negatives"), self.side_images(i), role="document")
                         for t, i in zip_longest(texts, images)]
            score = score_of(get("score"), self.builder)
        except UnusableImage as bad:
            raise Skipped(bad.reason, bad.detail) from None
        source = self.source
        if source.query_prompt and query.text is not None:
            query.text = source.query_prompt + query.text
        if source.query_instruction is not None:
            query.instruction = source.query_instruction
        return Example(
            query=query,
            positive=positive,
            negatives=[side for side in negatives if not side.is_empty],
            label=text_of(get("label")),
            score=score,
            row=number,
            source=self.file,
            source_name=source.name,
        )
