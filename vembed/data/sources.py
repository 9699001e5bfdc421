"""A split of the recipe's data loaded (`load_rows`): its files, tables and rows checked, kept rows as `PairRows`.

Its files are found by paths.py, read as tables by tables.py (one rank per node building the cache: node_lock.py),
every row checked (checks.py), the kept ones handed out as records made on fetch (rows.py), and what was skipped
reported (reports.py).

The entry points are `load_rows` and `load_examples`. Rows are checked column by column; unusable ones are skipped
and counted, and a share above data.max_bad_fraction stops the load. Images stay as absolute paths here; they are
decoded when a record is fetched by `PairDataset`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from vembed.data.node_lock import one_builder_per_node
from vembed.data.paths import builder_for, resolve_files
from vembed.data.reader import SKIP_FIXES, RowReader, Skipped, SourceSettings, row_number
from vembed.data.reports import MAX_BAD_ROWS_SHOWN, BadRow, DataReport, SourcesReport, check_bad_fraction
from vembed.data.tables import json_parts, open_table
from vembed.errors import DataError, RecipeError

if TYPE_CHECKING:
    from vembed.data.checks import RowChecks
    from vembed.data.records import Example
    from vembed.data.rows import PairRows
    from vembed.recipe import DataConfig

logger = logging.getLogger(__name__)


def load_rows(
    data_cfg: "DataConfig", split: str, *, num_hard_negatives: int | None = None
) -> "tuple[PairRows, DataReport | SourcesReport]":
    """The kept rows of `data.<split>` as records made on fetch, with a report of what was skipped and why.

    Rows without query or positive content, or naming an image file that does not exist, are skipped and counted;
    when their share exceeds `data.max_bad_fraction` a `DataError` names the counts and the first bad row.
    `num_hard_negatives` (else `data.num_hard_negatives`, else the smallest count among the kept rows) is the number
    of negatives each record keeps: longer lists are cut, rows with fewer are left out and counted as `short` (not
    bad data: they do not count against `data.max_bad_fraction`).
    For evaluation splits pass 0 when negatives are not used. A split of named sources gives their records one
    source after another (`PairRows.source_ranges`), each source checked, counted and given negatives on its own.
    """
    from vembed.data.rows import PairRows

    value = getattr(data_cfg, split, None)
    if value is None:
        raise RecipeError(f"data.{split}", "is not set; point it at a JSONL/CSV/Parquet file, glob or directory")
    from vembed.data.corpus import corpus_sources

    corpora = corpus_sources(data_cfg, split)
    if corpora:
        wanted = num_hard_negatives if num_hard_negatives is not None else data_cfg.num_hard_negatives
        return _load_corpus_pairs(data_cfg, split, corpora, wanted)
    if data_cfg.hard_negatives is not None and split == "train":
        raise RecipeError("data.hard_negatives", "gives negatives by id for a corpus folder; data.train is not one "
                                                 "(pairs files carry their negatives in a column)")
    sources = data_cfg.sources(split)
    if sources is None:
        wanted = num_hard_negatives if num_hard_negatives is not None else data_cfg.num_hard_negatives
        return _load_source(value, split, data_cfg.format, data_cfg.columns.model_dump(), data_cfg.image_root,
                            wanted, data_cfg.max_bad_fraction, SourceSettings(), data_cfg.score_range)
    loaded = {}
    for name, source in sources.items():
        wanted = num_hard_negatives if num_hard_negatives is not None else source.num_hard_negatives
        settings = SourceSettings(name, source.query_prompt, source.query_instruction)
        loaded[name] = _load_source(source.files, split, source.format, source.columns.model_dump(),
                                    source.image_root, wanted, data_cfg.max_bad_fraction, settings,
                                    data_cfg.score_range)
    rows = PairRows.concat([rows for rows, _ in loaded.values()])
    return rows, SourcesReport(split, {name: report for name, (_, report) in loaded.items()})


def _load_corpus_pairs(data_cfg: "DataConfig", split: str, corpora: dict, wanted: int | None
                       ) -> "tuple[Any, DataReport]":
    """A corpus folder's (query, relevant document) pairs (vembed/data/corpus.py, `CorpusPairs`), with hard
    negatives by id from data.hard_negatives."""
    from vembed.data.corpus import CorpusPairs, read_hard_negatives

    if None not in corpora:
        name = next(iter(corpora))
        raise RecipeError(f"data.{split}.{name}.files", "a corpus folder is not yet a named source of training data; "
                                                        f"give it as data.{split} itself")
    corpus = corpora[None].load()
    path = data_cfg.hard_negatives if split == "train" else None
    if path is not None and not os.path.isfile(path):
        raise RecipeError("data.hard_negatives", f"file {path!r} not found")
    negatives = read_hard_negatives(path, corpus) if path is not None else None
    if wanted is None:  # the smallest number the file lists for a query, as for pairs files; pairs it does not list
        # (queries `vembed mine` found too few negatives for) are left out as short
        counts = [len(found) for found in (negatives or {}).values()]
        wanted = min(counts) if counts else 0
    pairs = CorpusPairs(corpus, negatives, wanted)
    files = [corpus.folder] + ([path] if path else [])
    report = DataReport(split=split, files=files, total=pairs.total, kept=len(pairs), num_hard_negatives=wanted,
                        short=pairs.too_few)
    if not len(pairs):
        raise DataError(f"no (query, relevant document) pair of qrels/{corpus.split}.tsv is usable"
                        + (f" ({pairs.too_few} have fewer than {wanted} hard negatives)" if pairs.too_few else ""),
                        corpus.folder)
    check_bad_fraction(report, data_cfg.max_bad_fraction)
    logger.info(report.summary())
    return pairs, report


def load_examples(
    data_cfg: "DataConfig", split: str, *, num_hard_negatives: int | None = None
) -> "tuple[list[Example], DataReport | SourcesReport]":
    """`load_rows` with every record made now, as a list (evaluation splits, small data, the Python API)."""
    rows, report = load_rows(data_cfg, split, num_hard_negatives=num_hard_negatives)
    return list(rows), report


def _load_source(value: Any, split: str, format: str, columns: dict[str, str], image_root: str | None,
                 wanted: int | None, max_bad_fraction: float, settings: SourceSettings,
                 score_range: tuple[float, float] | None = None) -> "tuple[PairRows, DataReport]":
    from vembed.data.checks import check_rows
    from vembed.data.rows import PairRows, TablePart

    key = f"data.{split}.{settings.name}.files" if settings.name else f"data.{split}"
    files = resolve_files(value, format, key=key)
    report = DataReport(split=split, files=files, source=settings.name)
    checked: list[tuple[RowReader, Any, "RowChecks"]] = []
    empty: list[str] = []
    for file in files:
        builder = builder_for(file, format)
        with one_builder_per_node(file, builder):
            table = open_table(file, builder, split, columns)
            if table is None:
                empty.append(file)
                continue
            reader = RowReader(file, builder, columns, _image_base(file, image_root), settings,
                               json_parts=json_parts(table, columns))
            checks = check_rows(table, reader)
            if checks.read_the_table:
                # Checking read every page of the text columns into this process's memory map; training reads
                # rows from a fresh mapping of the same file, and the old one (and its pages) is let go.
                table = open_table(file, builder, split, columns)
        report.total += table.num_rows
        check_scores(reader, table, checks, score_range)
        _count_skipped(report, reader, table, checks)
        checked.append((reader, table, checks))

    usable = [(reader, table, checks, checks.reason == 0) for reader, table, checks in checked]
    if wanted is None:
        wanted = min((int(checks.negatives[ok].min()) for _, _, checks, ok in usable if ok.any()), default=0)
    parts = []
    for reader, table, checks, ok in usable:
        too_few = ok & (checks.negatives < wanted)
        report.short += int(too_few.sum())
        kept = _positions(ok & ~too_few)
        # Every row kept (the usual case): the checks as they are, not a second copy of them
        parts.append(TablePart(reader, table, kept, checks if len(kept) == len(ok) else _select(checks, kept), wanted))
    rows = PairRows(parts)
    report.kept, report.num_hard_negatives = len(rows), wanted
    check_bad_fraction(report, max_bad_fraction)
    for file in empty:  # said only when other files had rows; else the error above says it, once
        logger.warning("%s: no rows, ignored", file)
    logger.info(report.summary())
    return rows, report


def _positions(kept: np.ndarray) -> np.ndarray:
    """Positions of the kept rows, 4 bytes each where the table allows (a rank holds them for the whole run)."""
    positions = np.flatnonzero(kept)
    return positions.astype(np.int32) if len(kept) < 2**31 else positions


def _select(checks: "RowChecks", positions: np.ndarray) -> "RowChecks":
    from vembed.data.checks import FIELDS, RowChecks

    return RowChecks(*(getattr(checks, name)[positions] for name in FIELDS))


def check_scores(reader: RowReader, table: Any, checks: "RowChecks",
                 score_range: tuple[float, float] | None) -> None:
    """Scores are the training target, so a bad one stops the run (a skipped row would silently change it): a cell
    that is not a number or a list of numbers, a score outside data.score_range, a list of teacher scores whose
    length is not 1 + the row's hard negatives. One `DataError` naming the first such row."""
    from vembed.data.checks import CODE
    from vembed.data.rows import TablePart

    key = f"data.columns.score ({reader.columns['score']!r})"
    bad = np.flatnonzero(checks.reason == CODE["bad_score"])
    if len(bad):
        detail = "not a number"
        try:
            reader.example(TablePart(reader, table, bad, checks, 0)._row(int(bad[0])), row_number(bad[0]))
        except Skipped as skipped:
            detail = skipped.detail
        raise DataError(f"{key}: {detail} ({len(bad)} such rows); {SKIP_FIXES['bad_score']}", file=reader.file,
                        row=row_number(bad[0]))
    usable = checks.reason == 0
    if score_range is not None:
        low, high = score_range
        with np.errstate(invalid="ignore"):
            outside = usable & ((checks.score_low < low) | (checks.score_high > high))
        if outside.any():
            first = int(np.flatnonzero(outside)[0])
            found = checks.score_low[first] if checks.score_low[first] < low else checks.score_high[first]
            raise DataError(f"{key}: score {found:g} is outside data.score_range [{low:g}, {high:g}] "
                            f"({int(outside.sum())} such rows); fix the rows or widen data.score_range",
                            file=reader.file, row=row_number(first))
    lists = usable & (checks.scores > 0)
    wrong = lists & (checks.scores != checks.negatives + 1)
    if wrong.any():
        first = int(np.flatnonzero(wrong)[0])
        raise DataError(f"{key}: a list of {int(checks.scores[first])} teacher scores for a row with "
                        f"{int(checks.negatives[first])} hard negatives; give one score for the positive and one per "
                        f"negative ({int(checks.negatives[first]) + 1}), in order ({int(wrong.sum())} such rows)",
                        file=reader.file, row=row_number(first))


def _count_skipped(report: "DataReport", reader: RowReader, table: Any, checks: "RowChecks") -> None:
    """Add a file's skip counts to the report, and the first bad rows with the reader's own words for them."""
    from vembed.data.checks import REASONS
    from vembed.data.rows import TablePart

    bad = np.flatnonzero(checks.reason)
    if not len(bad):
        return
    codes, counts = np.unique(checks.reason[bad], return_counts=True)
    for code, count in zip(codes, counts):
        report.skipped[REASONS[code]] = report.skipped.get(REASONS[code], 0) + int(count)
    part = TablePart(reader, table, bad, checks, 0)
    for position in bad[: max(0, MAX_BAD_ROWS_SHOWN - len(report.bad_rows))]:
        reason, detail = REASONS[checks.reason[position]], "unusable row"
        try:
            reader.example(part._row(int(position)), row_number(position))
        except Skipped as skipped:
            reason, detail = skipped.reason, skipped.detail
        report.bad_rows.append(BadRow(reader.file, row_number(position), reason, detail))



def _image_base(file: str, image_root: str | None) -> str:
    if image_root is not None:
        return os.path.abspath(os.path.expanduser(image_root))
    path = os.path.abspath(file)
    return path if os.path.isdir(path) else os.path.dirname(path)
