"""What loading a split read: rows seen, kept and skipped per reason, the first bad rows (`DataReport`, one per
file set or named source; `SourcesReport` for a split of named sources), and the data.max_bad_fraction rule over them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vembed.data.reader import SKIP_FIXES
from vembed.errors import DataError

logger = logging.getLogger(__name__)

MAX_BAD_ROWS_SHOWN = 5


@dataclass
class BadRow:
    """One skipped row: `row` is its number in `file` as every data message gives it (reader.row_number); None when
    a whole file is lost (a stream's broken shard)."""

    file: str
    row: int | None
    reason: str  # a key of SKIP_FIXES
    detail: str

    def __str__(self) -> str:
        return f"{self.file}" + (f", row {self.row}" if self.row is not None else "") + f": {self.detail}"


@dataclass
class DataReport:
    """What `load_rows` read of one split (or one named source of it): rows seen, kept, skipped per reason, the first
    few bad rows."""

    split: str
    files: list[str]
    total: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    bad_rows: list[BadRow] = field(default_factory=list)  # the first MAX_BAD_ROWS_SHOWN
    num_hard_negatives: int = 0  # negatives per kept record, after truncation
    source: str | None = None  # the named source (data.train: {name: ...}), if any
    # Rows left out for holding fewer hard negatives than num_hard_negatives. Not bad data (`vembed mine` leaves out
    # queries it found too few negatives for, on purpose), so not counted against data.max_bad_fraction.
    short: int = 0

    @property
    def key(self) -> str:
        """The recipe key these rows came from: data.train, or data.train.<source>."""
        return f"data.{self.split}" + (f".{self.source}" if self.source else "")

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        files = f"{len(self.files)} files" if len(self.files) != 1 else self.files[0]
        name = f"{self.split}/{self.source}" if self.source else self.split
        text = f"{name}: kept {self.kept} of {self.total} rows from {files}"
        if self.skipped:
            text += " (skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) + ")"
        text += f"; {self.num_hard_negatives} hard negatives per record"
        return text + (f" ({self.short} rows with fewer left out)" if self.short else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "files": list(self.files),
            "total": self.total,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "bad_rows": [vars(bad).copy() for bad in self.bad_rows],
            "num_hard_negatives": self.num_hard_negatives,
            "short_of_negatives": self.short,
            **({"source": self.source} if self.source else {}),
        }


@dataclass
class SourcesReport:
    """What `load_rows` read from a split of named sources: one `DataReport` per source."""

    split: str
    sources: dict[str, "DataReport"]

    @property
    def num_skipped(self) -> int:
        return sum(report.num_skipped for report in self.sources.values())

    @property
    def kept(self) -> int:
        return sum(report.kept for report in self.sources.values())

    @property
    def total(self) -> int:
        return sum(report.total for report in self.sources.values())

    def summary(self) -> str:
        return "; ".join(report.summary() for report in self.sources.values())

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "sources": {name: report.to_dict() for name, report in self.sources.items()}}


def unusable_share(report: "DataReport | SourcesReport", found_later: float = 0.0) -> float:
    """What data.max_bad_fraction limits: the share of the rows read that are unusable, those skipped when read plus
    `found_later` records found unusable since (images that do not decode). Rows left out for too few hard negatives
    are read but not bad (see DataReport.short)."""
    return (report.num_skipped + found_later) / max(report.total, 1)


def check_bad_fraction(report: DataReport, max_bad_fraction: float) -> None:
    where = report.files[0] if len(report.files) == 1 else None
    if report.total == 0:
        raise DataError(f"{report.key} has no rows", file=where)
    first = report.bad_rows[0] if report.bad_rows else None
    counts = ", ".join(f"{n} {reason}" for reason, n in sorted(report.skipped.items()))
    if report.kept == 0 and first is None:  # every row short of negatives
        raise DataError(f"no usable rows in {report.key}: all {report.total} have fewer than "
                        f"{report.num_hard_negatives} hard negatives; {SKIP_FIXES['too_few_negatives']}", file=where)
    if report.short:
        counts += f"; {report.short} left out with fewer than {report.num_hard_negatives} hard negatives"
    if report.kept == 0:
        raise DataError(
            f"no usable rows in {report.key}: all {report.total} skipped ({counts}); "
            f"first bad row: {first.detail}; {SKIP_FIXES[first.reason]}",
            file=first.file,
            row=first.row,
        )
    fraction = unusable_share(report)
    if fraction > max_bad_fraction:
        raise DataError(
            f"{report.num_skipped} of {report.total} rows of {report.key} are unusable ({counts}; "
            f"{fraction:.1%} > data.max_bad_fraction={max_bad_fraction}); first bad row: {first.detail}; "
            f"{SKIP_FIXES[first.reason]}, or raise data.max_bad_fraction or fix the rows",
            file=first.file,
            row=first.row,
        )
    if report.num_skipped:
        logger.warning("%s; first bad row: %s", report.summary(), first)
