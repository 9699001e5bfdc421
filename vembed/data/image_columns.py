"""The image files the kept rows of a table use, read from its image columns (Arrow kernels over whole columns), so
no record is made: what the image cache needs to know at every launch.

Each distinct cell is resolved once with `RowReader`'s own rules (relative paths, lists, CSV cells holding JSON
lists), so the files found are exactly those the records name. Hard negatives count only as far as a record keeps
them: the first `num_negatives` non-empty (text or image) of each row, as `RowReader.example` pairs them.
"""

from __future__ import annotations

from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import numpy as np

from vembed.data.reader import UnusableImage, as_list, side_text

if TYPE_CHECKING:
    from vembed.data.rows import TablePart


def image_paths(part: "TablePart") -> set[str]:
    """The image files of `part`'s kept rows: query and positive images, and those of the hard negatives each record
    keeps. A table none of whose rows holds an image (the checks' counts) reads no column."""
    if not len(part.rows) or not part.checks.max_images.any():
        return set()
    names = {p: name for p, name in part.reader.columns.items() if name in part.table.column_names}
    found: set[str] = set()
    for side in ("query_image", "positive_image"):
        if side in names:
            found |= _resolved(part, side, _distinct(_column(part, names[side])))
    if part.num_negatives and "negative_images" in names:
        found |= _negative_images(part, names)
    return found


def _column(part: "TablePart", name: str) -> Any:
    """A column of the kept rows: an Arrow array, or a Python list for a small file read without `datasets`."""
    table, rows = part.table, part.rows
    if hasattr(table, "records"):
        return [table.records[int(row)].get(name) for row in rows]  # small files only (SMALL_JSON_BYTES)
    column = table.data.column(name)
    if len(rows) != len(column) or not np.array_equal(rows, np.arange(len(column))):
        column = column.take(rows)
    return column.combine_chunks() if hasattr(column, "combine_chunks") else column


def _distinct(values: Any) -> list[Any]:
    """The distinct image cells of a side's column (lists flattened: every image of a side counts)."""
    if isinstance(values, list):
        return values
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = values.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _distinct(pc.list_flatten(values))
    if pa.types.is_struct(kind):  # a datasets Image feature: {bytes, path}; embedded bytes are no file
        values = _struct_paths(values)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return pc.unique(values.drop_null()).to_pylist()
    return values.to_pylist()


def _struct_paths(values: Any) -> Any:
    import pyarrow.compute as pc

    names = [values.type.field(i).name for i in range(values.type.num_fields)]
    if "path" not in names:
        return values
    path = pc.struct_field(values, "path")
    if "bytes" not in names:
        return path
    embedded = pc.fill_null(pc.greater(pc.binary_length(pc.struct_field(values, "bytes")), 0), False)
    return path.filter(pc.invert(embedded))


def _resolved(part: "TablePart", side: str, cells: list[Any]) -> set[str]:
    """The files of distinct cells, by the reader's rules; a cell that no longer resolves (a file deleted since the
    checks) is left out: its record is replaced when fetched, as without a cache."""
    reader, found = part.reader, set()
    for cell in cells:
        try:
            images = reader.side_images(reader.cell(side, cell))
        except UnusableImage:
            continue
        for image in images if isinstance(images, list) else [images]:
            if isinstance(image, str):
                found.add(image)
    return found


def _negative_images(part: "TablePart", names: dict[str, str]) -> set[str]:
    images = _column(part, names["negative_images"])
    texts = _column(part, names["negatives"]) if "negatives" in names else None
    kept = _kept_negative_images(part, images, texts)
    if kept is not None:
        return _resolved(part, "negative_images", _distinct(kept))
    return _negative_images_by_cell(part, images, texts)


def _kept_negative_images(part: "TablePart", images: Any, texts: Any) -> Any | None:
    """The image cells of the negatives each row keeps, by Arrow and numpy over the flattened lists, for the usual
    layout (a list column of images, a list column of texts or none); None for any other (parsed cell by cell)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from vembed.data.checks import _texts_present

    def is_list(values: Any) -> bool:
        return isinstance(values, (pa.Array, pa.ChunkedArray)) and (
            pa.types.is_list(values.type) or pa.types.is_large_list(values.type))

    if not is_list(images) or (texts is not None and not is_list(texts)) or part.reader.json_parts:
        return None
    flat = pc.list_flatten(images)
    kind = flat.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        has_image, _ = _texts_present(flat, len(flat))  # not null, not blank: what `side_images` takes as a path
    elif pa.types.is_struct(kind):
        has_image = np.zeros(len(flat), dtype=bool)
        for field in ("bytes", "path"):
            if kind.get_field_index(field) >= 0:
                value = pc.struct_field(flat, field)
                has_image |= np.asarray(pc.fill_null(pc.greater(pc.binary_length(value), 0), False), dtype=bool)
    else:
        return None
    rows, starts = _positions(images)
    index = np.arange(len(flat)) - starts[rows]  # each element's place in its row's list
    has_text = np.zeros(len(flat), dtype=bool)
    if texts is not None:
        text_flat = pc.list_flatten(texts)
        if not (pa.types.is_string(text_flat.type) or pa.types.is_large_string(text_flat.type)):
            return None
        present, _ = _texts_present(text_flat, len(text_flat))
        lengths = np.asarray(pc.fill_null(pc.list_value_length(texts), 0), dtype=np.int64)
        text_starts = np.cumsum(lengths) - lengths
        paired = index < lengths[rows]  # zip_longest: the text at the same place, if the row has one
        has_text[paired] = present[text_starts[rows[paired]] + index[paired]]
    counted = (has_image | has_text).astype(np.int64)
    before = np.cumsum(counted) - counted  # non-empty negatives before each element, over the whole column
    rank = before - before[starts[rows]]  # ... in the element's own row
    return flat.filter(pa.array(has_image & (rank < part.num_negatives)))


def _positions(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """For a list column: the row of each flattened element, and where each row's elements start."""
    import pyarrow.compute as pc

    lengths = np.asarray(pc.fill_null(pc.list_value_length(values), 0), dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    return np.repeat(np.arange(len(lengths)), lengths), starts


def _negative_images_by_cell(part: "TablePart", images: Any, texts: Any) -> set[str]:
    """Other layouts (CSV cells holding JSON lists, JSON-typed columns, small files): cell by cell, as
    `RowReader.example` pairs texts and images."""
    reader, found = part.reader, set()
    image_cells = images if isinstance(images, list) else images.to_pylist()
    text_cells = [None] * len(image_cells) if texts is None else texts if isinstance(texts, list) else texts.to_pylist()
    for text_cell, image_cell in zip(text_cells, image_cells):
        kept = 0
        pairs = zip_longest(as_list(reader.cell("negatives", text_cell), reader.builder),
                            as_list(reader.cell("negative_images", image_cell), reader.builder))
        for text, image in pairs:
            if kept == part.num_negatives:
                break
            try:
                text, image = side_text(text, "negatives"), reader.side_images(image)
            except UnusableImage:
                break
            if text is None and image is None:
                continue
            kept += 1
            found.update(path for path in (image if isinstance(image, list) else [image]) if isinstance(path, str))
    return found
