"""Streamed training data, for corpora larger than a disk: WebDataset tar shards, or JSONL/CSV/Parquet files read as a
stream by `datasets`; records are decoded, collated and handed out batch by batch, never all held at once.

What an epoch is (docs/guides/data.md, "Streaming"):
- one pass over every shard (a tar file, or one data file). Each epoch the shard list is shuffled from (seed, epoch)
  and dealt to the ranks evenly by samples, each rank's share to its workers the same way (`deal_shards`): slot =
  rank x data.num_workers + worker, so slots read disjoint shards;
- each slot reads its shards in that order through a shuffle buffer of `data.shuffle_buffer` samples, seeded from
  (seed, epoch, slot), so the order depends on nothing but those and the shards;
- each slot collates its own batches of `batch_size`; a rank's DataLoader takes them from its workers round-robin;
- every rank must take equally many batches (DDP gathers embeddings every step), so all ranks stop the epoch as soon
  as one runs out (vembed/training/streamed.py); the shard sizes in `sizes.json` (open_clip's index file, beside the
  shards) say in advance how many batches that is, which gives the schedule its length, and how many samples the
  epoch leaves unread (the ranks' surplus over the smallest, each slot's incomplete last batch; `unread_samples`).

Exact resume is replay: the position of a slot is the number of samples it has drawn from its shuffle buffer.
Resuming rebuilds the slot's stream from (seed, epoch, slot) and drops that many samples without decoding them (the
tar bytes are read again, images are not decoded; measured in docs/benchmarks.md). Samples whose image does not decode
or whose text is missing are skipped and counted per slot, like rows of the map-style path; a shard that breaks off
(or gives fewer samples than `sizes.json` lists) counts every sample it lost, so `max_bad_fraction` sees them.

Why not the libraries' own resume: `datasets.IterableDataset.state_dict()` drops the shuffle buffer on resume (its
docstring says so), and webdataset has no resume at all; both shuffle deterministically, which is all replay needs.
Tar parsing and the shuffle buffer are webdataset's; file parsing is `datasets`'. Reading a shard and turning its
samples into `Example`s is in `stream_samples.py`; the loop's side (ranks stopping together, checkpoints) in
`vembed/training/streamed.py`.
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset, get_worker_info

from vembed.data.reader import SKIP_FIXES
from vembed.data.records import Example
from vembed.data.reports import MAX_BAD_ROWS_SHOWN, BadRow, DataReport
from vembed.data.stream_samples import READERS, RawRecord, SampleDecoder, SampleSkipped
from vembed.errors import DataError, EnvironmentProblem, RecipeError

if TYPE_CHECKING:
    from vembed.recipe import DataConfig

SIZES_FILE = "sizes.json"  # open_clip's index: {"shard-000000.tar": number of samples, ...}, beside the shards
# img2dataset writes `{shard}_stats.json` beside each `{shard}.tar` ({"count": N, "successes": S, ...}); its tar holds
# the S samples that downloaded (the failures are in its .parquet only).
STATS_SUFFIX = "_stats.json"
# A held-out split given as tar shards is read whole for evaluation, so it is bounded: data.eval_max_samples, or this.
SHARD_EVAL_MAX_SAMPLES = 10_000
TAR_EXTENSION = ".tar"
EXTRA_SKIP_FIXES = {  # reasons a stream meets beside the map-style ones (sources.SKIP_FIXES); bad_text covers both
    "bad_text": "write text as UTF-8 strings (a number or list where text is expected: check data.columns)",
    "bad_json": "make every .json member one valid JSON object",
    "bad_shard": "check the shard: it is missing, truncated or not a tar / data file",
    "too_many_images": "give one image per side (only qwen_vl embeds several)",
    "missing_modality": "give every sample text and an image (a dual encoder trains both towers every step)",
    "missing_label": "give every sample a label (data.columns.label), or map it to the column that holds them",
    "documents_and_negatives": "give a documents list (the positive, then the hard negatives) or a negatives list, "
                               "not both",
}
STREAM_SKIP_FIXES = {**SKIP_FIXES, **EXTRA_SKIP_FIXES}


# --- finding shards --------------------------------------------------------------------------------------------------


def _expand_braces(item: str) -> list[str]:
    """`train-{00000..00007}.tar` → 8 names (WebDataset's brace notation, expanded by its `braceexpand` dependency)."""
    if "{" not in item:
        return [item]
    try:
        import braceexpand
    except ImportError:
        return [item]
    return list(braceexpand.braceexpand(item))


def expand_sources(value: str | Sequence[str]) -> list[str]:
    """Paths a data.train value names: brace patterns expanded, globs matched, directories' tar shards listed."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    found: list[str] = []
    for item in items:
        for name in _expand_braces(os.path.expanduser(os.fspath(item))):
            if os.path.isdir(name):
                found += sorted(os.path.join(name, f) for f in os.listdir(name) if f.endswith(TAR_EXTENSION))
            elif glob.has_magic(name):
                found += sorted(glob.glob(name, recursive=True))
            else:
                found.append(name)
    return found


def names_tar_shards(value: str | Sequence[str] | None) -> bool:
    """Whether a `data.train` value names WebDataset tar shards (what `data.streaming` unset decides on)."""
    if value is None or isinstance(value, dict):  # named sources: read memory-mapped (vembed/data/rows.py)
        return False
    return any(path.endswith(TAR_EXTENSION) for path in expand_sources(value))


def wants_streaming(data_cfg: "DataConfig") -> bool:
    """`data.streaming`, or when unset: on exactly when data.train names tar shards (they cannot be read whole)."""
    if data_cfg.streaming is not None:
        return data_cfg.streaming
    return names_tar_shards(data_cfg.train)


def find_shards(data_cfg: "DataConfig", split: str = "train") -> tuple[str, list[str]]:
    """(backend, absolute shard paths) of a split (the training split, or a held-out split of tar shards). Backend
    "webdataset" for tar shards, "datasets" for JSONL/CSV/Parquet files. Absolute paths also keep webdataset from
    reading a `pipe:` name as a command."""
    key = f"data.{split}"
    value = getattr(data_cfg, split)
    if value is None:
        raise RecipeError(key, "is required for training; point it at tar shards or JSONL/CSV/Parquet files")
    candidates = expand_sources(value)
    tars = [path for path in candidates if path.endswith(TAR_EXTENSION)]
    if tars:
        if len(tars) != len(candidates):
            other = next(path for path in candidates if not path.endswith(TAR_EXTENSION))
            raise RecipeError(key, f"mixes tar shards with other files ({other!r}); stream one kind of source")
        missing = [path for path in tars if not os.path.isfile(path)]
        if missing:
            raise RecipeError(key, f"shard {missing[0]!r} not found ({len(missing)} of {len(tars)} missing); "
                                   f"relative paths start at {os.getcwd()!r}")
        return "webdataset", [os.path.abspath(path) for path in dict.fromkeys(tars)]
    if data_cfg.format in ("hf", "shards"):
        raise RecipeError("data.streaming", f"cannot stream format {data_cfg.format!r}; stream tar shards or "
                                            "JSONL/CSV/Parquet files, or set data.streaming: false")
    from vembed.data.paths import resolve_files

    files = resolve_files(value, data_cfg.format, key=key)
    return "datasets", [os.path.abspath(path) for path in files]


def stats_size(path: str) -> int | None:
    """The samples of a tar shard by img2dataset's `{shard}_stats.json` beside it (its "successes"); None without."""
    if not path.endswith(TAR_EXTENSION):
        return None
    stats = path[:-len(TAR_EXTENSION)] + STATS_SUFFIX
    if not os.path.isfile(stats):
        return None
    try:
        successes = json.loads(open(stats).read())["successes"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"cannot read the shard's img2dataset stats ({type(err).__name__}: {err}); fix or delete it",
                        file=stats) from None
    if not isinstance(successes, int) or successes < 0:
        raise DataError(f'"successes" is {successes!r}, not a count; fix or delete it', file=stats)
    return successes


def read_sizes(paths: Sequence[str]) -> list[int | None]:
    """Samples per shard from `sizes.json` beside each shard (open_clip's format: file name → count), else from
    img2dataset's `{shard}_stats.json`, or, for a Parquet file, from its footer; None where none says."""
    by_dir: dict[str, dict[str, int]] = {}
    sizes: list[int | None] = []
    for path in paths:
        directory, name = os.path.split(path)
        if directory not in by_dir:
            index = os.path.join(directory, SIZES_FILE)
            try:
                by_dir[directory] = json.loads(open(index).read()) if os.path.isfile(index) else {}
            except (OSError, ValueError) as err:
                raise DataError(f"cannot read the shard index: {err}", file=index) from None
        size = by_dir[directory].get(name)
        if size is None:
            size = stats_size(path)
        if size is None and path.endswith(".parquet"):
            import pyarrow.parquet as pq

            size = pq.read_metadata(path).num_rows
        sizes.append(int(size) if size is not None else None)
    return sizes


# --- the plan of an epoch (its batches per rank by the shard index; not the launch or memory plan) ----------------


def mix_seed(*parts: int) -> int:
    """One 64-bit seed from several integers (numpy's SeedSequence: independent streams for nearby inputs)."""
    import numpy as np

    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0])


@dataclass(frozen=True)
class Shard:
    path: str
    num_samples: int | None  # from sizes.json; None when unknown


@dataclass(frozen=True)
class StreamLayout:
    """Who reads: `world` ranks with `workers` slots each (DataLoader workers; 1 when data.num_workers is 0)."""

    world: int
    rank: int
    workers: int

    @property
    def slots(self) -> int:
        return self.world * self.workers


def epoch_shards(shards: Sequence[Shard], seed: int, epoch: int) -> list[Shard]:
    order = list(shards)
    random.Random(mix_seed(seed, epoch)).shuffle(order)
    return order


def _deal(order: Sequence[Shard], parts: int) -> list[list[Shard]]:
    """`order` dealt to `parts` as evenly by samples as whole shards allow: largest first (a stable sort, so equal
    sizes keep the shuffled order), each to the part holding the fewest samples so far (then fewest shards, then the
    lowest index); no part ends more than one shard's size above another. Each part reads in `order`'s order.
    A shard of unknown size weighs the mean of the known ones (all unknown: each weighs 1, dealt like cards)."""
    import heapq

    known = [shard.num_samples for shard in order if shard.num_samples is not None]
    mean = sum(known) / len(known) if known else 1
    weight = [shard.num_samples if shard.num_samples is not None else mean for shard in order]
    loads = [(0.0, 0, part) for part in range(parts)]  # (samples, shards, part): a heap, the least loaded on top
    owner = [0] * len(order)
    for index in sorted(range(len(order)), key=lambda i: -weight[i]):
        samples, count, part = loads[0]
        owner[index] = part
        heapq.heapreplace(loads, (samples + weight[index], count + 1, part))
    dealt: list[list[Shard]] = [[] for _ in range(parts)]
    for shard, part in zip(order, owner):
        dealt[part].append(shard)
    return dealt


def deal_shards(shards: Sequence[Shard], seed: int, epoch: int, layout: StreamLayout) -> list[list[Shard]]:
    """The shards each slot reads in `epoch`, in order, by slot: the epoch's shuffled list dealt to the ranks, each
    rank's share to its workers, both evenly by samples (`_deal`). Ranks first: a rank's surplus over the smallest
    rank goes unread (every rank takes as many batches as the one with fewest), a worker's is read by the rank."""
    slots: list[list[Shard]] = []
    for rank_shards in _deal(epoch_shards(shards, seed, epoch), layout.world):
        slots += _deal(rank_shards, layout.workers)
    return slots


def planned_batches(shards: Sequence[Shard], seed: int, epoch: int, layout: StreamLayout,
                    batch_size: int) -> int | None:
    """Batches every rank can take in `epoch` (the fewest any rank has), from the shard sizes; None if a size is
    unknown. Each slot batches its own samples, so each slot's last incomplete batch is dropped."""
    if any(shard.num_samples is None for shard in shards):
        return None
    per_slot = [sum(s.num_samples for s in slot) // batch_size for slot in deal_shards(shards, seed, epoch, layout)]
    return min(sum(per_slot[rank * layout.workers:(rank + 1) * layout.workers]) for rank in range(layout.world))


# --- positions and skip counts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokenShard:
    """A shard that failed to read, or gave fewer samples than `sizes.json` lists: what it lost counts as skipped."""

    file: str
    lost: int  # samples it should have given and did not, by sizes.json; 1 for an unreadable shard of unknown size
    sized: bool  # whether sizes.json gave its size (else `lost` is a floor: what it held is not known)
    detail: str


def broken_shard(shard: Shard, read: int, errors: Sequence[Exception]) -> BrokenShard | None:
    """What `shard` lost when it gave `read` samples and raised `errors` while read; None when it gave all it lists.
    A tar cut at a member boundary raises nothing, hence the count against the index."""
    expected = shard.num_samples
    short = expected - read if expected is not None else 0
    if not errors and short <= 0:
        return None
    error = errors[0] if errors else None
    what = f"{type(error).__name__}: {error.args[0] if error.args else error}" if error else "ended early"
    if expected is None:
        return BrokenShard(shard.path, 1, False, f"{what}; gave {read} samples and its size is unknown (not in "
                                                 f"{SIZES_FILE}): counted as 1 lost")
    return BrokenShard(shard.path, max(short, 1), True,
                       f"{what}; gave {read} of the {expected} samples {SIZES_FILE} lists")


@dataclass
class SlotPosition:
    """How far one slot is in its epoch: samples drawn from its shuffle buffer (kept or skipped), and the skips."""

    slot: int
    drawn: int = 0
    ended: bool = False  # the slot has read all its shards (its last item, with no batch, said so)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    bad_rows: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_BAD_ROWS_SHOWN, as BadRow fields
    lost: int = 0  # samples broken shards should have given (never drawn; also counted as skipped "bad_shard")
    unsized_broken: int = 0  # broken shards of unknown size, each counted as 1 lost

    def skip(self, file: str, row: int | None, reason: str, detail: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count
        if len(self.bad_rows) < MAX_BAD_ROWS_SHOWN:
            self.bad_rows.append(asdict(BadRow(file, row, reason, detail)))

    def skip_shard(self, broken: BrokenShard) -> None:
        self.skip(broken.file, None, "bad_shard", broken.detail, count=broken.lost)  # a shard, not one of its rows
        self.lost += broken.lost
        self.unsized_broken += not broken.sized

    def to_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "drawn": self.drawn, "ended": self.ended, "skipped": dict(self.skipped),
                "bad_rows": [dict(row) for row in self.bad_rows], "lost": self.lost,
                "unsized_broken": self.unsized_broken}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SlotPosition":
        return cls(slot=int(raw["slot"]), drawn=int(raw["drawn"]), ended=bool(raw.get("ended", False)),
                   skipped=dict(raw.get("skipped", {})), bad_rows=[dict(row) for row in raw.get("bad_rows", [])],
                   lost=int(raw.get("lost", 0)), unsized_broken=int(raw.get("unsized_broken", 0)))


@dataclass
class StreamReport(DataReport):
    """The skip report of a streamed split: what the last epoch read so far, summed over every rank and worker."""

    backend: str = "webdataset"
    planned_samples: int | None = None  # samples per epoch, by sizes.json
    batches_per_rank: int | None = None  # in the first epoch, by sizes.json
    epoch: int = 0
    unsized_broken: int = 0  # broken shards of unknown size in the epoch (each counted as 1 lost sample)
    unread_per_epoch: list[int] | None = None  # samples the planned epochs leave unread, by sizes.json

    def summary(self) -> str:
        shards = f"{len(self.files)} shard{'s' if len(self.files) != 1 else ''} ({self.backend})"
        size = f"{self.planned_samples} samples per epoch" if self.planned_samples is not None else "size unknown"
        text = f"{self.split}: streaming {shards}, {size}"
        if self.batches_per_rank is not None and not self.total:
            text += f", {self.batches_per_rank} batches per rank"
            text += self._unread_text()
        if self.total:
            text += f"; epoch {self.epoch}: kept {self.kept} of {self.total} samples"
        if self.skipped:
            text += " (skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) + ")"
        if self.unsized_broken:
            text += (f"; {self.unsized_broken} broken shard(s) not in {SIZES_FILE}, each counted as 1 lost sample: "
                     "what they held is unknown")
        return text + f"; {self.num_hard_negatives} hard negatives per record"

    def _unread_text(self) -> str:
        unread = self.unread_per_epoch
        if not unread or self.planned_samples is None:
            return ""
        low, high = min(unread), max(unread)
        if high == 0:
            return "; every sample read each epoch"
        share = f"{high / max(self.planned_samples, 1):.1%}"
        if len(unread) == 1:
            amount = f"{high} samples ({share}) unread in epoch 0"
        elif low == high:
            amount = f"{high} samples ({share}) unread per epoch"
        else:
            amount = f"{low}-{high} samples (up to {share}) unread per epoch"
        return (f"; {amount}: ranks' surplus over the smallest rank and readers' incomplete last batches, not "
                "carried over (each epoch deals anew)")

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"unsized_broken_shards": self.unsized_broken} if self.unsized_broken else {}
        if self.unread_per_epoch is not None:
            extra["unread_per_epoch"] = list(self.unread_per_epoch)
        return {**super().to_dict(), **extra}

    def merge_positions(self, epoch: int, positions: Sequence[SlotPosition | dict[str, Any]]) -> None:
        """Counts of `epoch` from every slot's position (all ranks' positions, once gathered)."""
        self.epoch, self.total, self.skipped, self.bad_rows, self.unsized_broken = epoch, 0, {}, [], 0
        for position in positions:
            position = position if isinstance(position, SlotPosition) else SlotPosition.from_dict(position)
            self.total += position.drawn + position.lost  # a broken shard's lost samples were due in the epoch too
            self.unsized_broken += position.unsized_broken
            for reason, count in position.skipped.items():
                self.skipped[reason] = self.skipped.get(reason, 0) + count
            for row in position.bad_rows:
                if len(self.bad_rows) < MAX_BAD_ROWS_SHOWN:
                    self.bad_rows.append(BadRow(**row))
        self.kept = self.total - self.num_skipped

    def check_bad_fraction(self, max_bad_fraction: float, *, epoch_done: bool) -> None:
        """The map-style rule per epoch: stop when more than `max_bad_fraction` of the samples are unusable; before the
        epoch ends, as soon as the skips alone exceed that share of the epoch's planned size (it cannot pass then)."""
        skipped = self.num_skipped
        if not skipped:
            return
        if epoch_done:
            over = self.total and skipped / self.total > max_bad_fraction
            share = f"{skipped / max(self.total, 1):.1%}"
        else:
            over = self.planned_samples is not None and skipped > max_bad_fraction * self.planned_samples
            share = f"already {skipped / max(self.planned_samples or 1, 1):.1%} of the epoch's {self.planned_samples}"
        if not over:
            return
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        first = self.bad_rows[0] if self.bad_rows else None
        fix = STREAM_SKIP_FIXES.get(first.reason, "fix the samples") if first else "fix the samples"
        raise DataError(
            f"{skipped} of {self.total} samples read in epoch {self.epoch} of data.{self.split} are unusable "
            f"({counts}; {share} > data.max_bad_fraction={max_bad_fraction})"
            + (f"; first bad sample: {first.detail}" if first else "")
            + f"; {fix}, or raise data.max_bad_fraction",
            file=first.file if first else None,
            row=first.row if first else None,
        )


def require_backend(backend: str, key: str = "data.train") -> None:
    """Both backends shuffle through webdataset's buffer; tar shards are also parsed by it."""
    import importlib.util

    if importlib.util.find_spec("webdataset") is None:
        what = "names tar shards, which stream" if backend == "webdataset" else "streams"
        if key != "data.train":
            what = "reads tar shards"
        raise EnvironmentProblem(key, f"{what} through the webdataset package; pip install 'vembed[streaming]'")


# --- the stream ----------------------------------------------------------------------------------------------------


class ShardStream(IterableDataset):
    """The training stream of one rank: `iter()` in worker w yields (position, batch) pairs of one slot, then one
    (position, None) when the slot has read everything, so the skips after its last full batch are counted too.

    Set up with `set_layout` and `start_epoch` before each `iter()` (the DataLoader copies it into fresh workers).
    `position` is the slot's `SlotPosition.to_dict()` after the samples of `batch`: what a checkpoint stores. A slot
    resumed from an ended position yields nothing, as its worker, done, yielded nothing more in the first run.
    """

    def __init__(self, backend: str, shards: Sequence[Shard], decoder: Callable[[RawRecord, SlotPosition],
                 Example | None], collate: Callable[[list[Example]], Any], *, batch_size: int, seed: int,
                 shuffle_buffer: int):
        self.backend, self.shards = backend, list(shards)
        self.decoder, self.collate = decoder, collate
        self.batch_size, self.seed, self.shuffle_buffer = batch_size, seed, shuffle_buffer
        self.layout = StreamLayout(world=1, rank=0, workers=1)
        self.epoch, self.starts, self.first_worker = 0, {}, 0
        self._planned: dict[tuple[int, StreamLayout], int | None] = {}  # the plan is asked for often; dealing costs

    @property
    def files(self) -> list[str]:
        return [shard.path for shard in self.shards]

    def set_layout(self, layout: StreamLayout) -> None:
        self.layout = layout

    def start_epoch(self, epoch: int, starts: dict[int, SlotPosition] | None = None, first_worker: int = 0) -> None:
        """The next `iter()` reads `epoch` from `starts` (slot → position; absent slots from the beginning); worker 0
        plays local slot `first_worker`, worker 1 the next, and so on, so that a resumed DataLoader, which starts at
        worker 0, continues the round-robin where the interrupted one was."""
        self.epoch, self.starts, self.first_worker = epoch, dict(starts or {}), first_worker

    def planned_batches(self, epoch: int) -> int | None:
        key = (epoch, self.layout)
        if key not in self._planned:
            self._planned[key] = planned_batches(self.shards, self.seed, epoch, self.layout, self.batch_size)
        return self._planned[key]

    def planned_samples(self) -> int | None:
        sizes = [shard.num_samples for shard in self.shards]
        return None if any(size is None for size in sizes) else sum(sizes)

    def slot_of_worker(self, worker: int) -> int:
        return self.layout.rank * self.layout.workers + (worker + self.first_worker) % self.layout.workers

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.layout.workers:
            raise RuntimeError(f"internal: the stream was laid out for {self.layout.workers} workers, the DataLoader "
                               f"has {info.num_workers}")
        slot = self.slot_of_worker(worker)
        start = self.starts.get(slot)
        if start is None or not start.ended:
            yield from self._slot_batches(slot, start)

    def slot_samples(self, slot: int, on_broken: Callable[[BrokenShard], None]) -> Iterator[RawRecord]:
        """The raw samples of `slot` in this epoch, in training order (shuffled through the buffer), undecoded.
        Each shard that fails or gives fewer samples than its size goes to `on_broken` once it is read."""
        import webdataset

        def records() -> Iterator[RawRecord]:
            for shard in deal_shards(self.shards, self.seed, self.epoch, self.layout)[slot]:
                errors: list[Exception] = []
                read = 0
                for record in READERS[self.backend]([shard.path], lambda file, exn: errors.append(exn)):
                    read += 1
                    yield record
                broken = broken_shard(shard, read, errors)
                if broken is not None:
                    on_broken(broken)

        buffer = webdataset.shuffle(bufsize=self.shuffle_buffer, initial=self.shuffle_buffer,
                                    rng=random.Random(mix_seed(self.seed, self.epoch, slot)))
        return buffer(records())

    def _slot_batches(self, slot: int, start: SlotPosition | None) -> Iterator[tuple[dict[str, Any], Any]]:
        position = SlotPosition.from_dict(start.to_dict()) if start is not None else SlotPosition(slot)
        resume_at = position.drawn
        replaying = resume_at > 0

        def on_broken(broken: BrokenShard) -> None:
            # During the replay the same broken shards recur; they were counted before the checkpoint.
            if not replaying:
                position.skip_shard(broken)

        pending: list[Example] = []
        for drawn, record in enumerate(self.slot_samples(slot, on_broken), start=1):
            if drawn <= resume_at:  # replay: drawn before the checkpoint, dropped undecoded
                replaying = drawn < resume_at  # errors met after this point were not counted before
                continue
            position.drawn = drawn
            example = self.decoder(record, position)
            if example is None:
                continue
            pending.append(example)
            if len(pending) == self.batch_size:
                yield position.to_dict(), self.collate(pending)
                pending = []
        position.ended = True  # an incomplete last batch is dropped, as in the map-style path
        yield position.to_dict(), None


def open_stream(data_cfg: "DataConfig", required: Mapping[str, str] | None = None) -> tuple[str, list[Shard]]:
    """The training shards with their sizes, checked: backend installed, files present, and the first sample has
    the columns of a query and a positive, and of each part in `required` (part -> what needs it). Reading that
    sample also loads the readers' modules in this process, so DataLoader workers forked from it start at once (a
    first `datasets.load_dataset` takes seconds)."""
    backend, paths = find_shards(data_cfg)
    require_backend(backend)
    _check_first_sample(backend, paths[0], data_cfg.columns.model_dump(), required or {})
    return backend, [Shard(path, size) for path, size in zip(paths, read_sizes(paths))]


def _check_first_sample(backend: str, path: str, columns: dict[str, str], required: Mapping[str, str]) -> None:
    errors: list[str] = []
    record = next(READERS[backend]([path], lambda file, exn: errors.append(f"{type(exn).__name__}: {exn}")), None)
    if record is None:
        raise DataError(f"cannot read a first sample: {errors[0] if errors else 'the shard is empty'}", file=path)
    decoder = SampleDecoder(columns, None, 0, None)
    try:
        parts = decoder.parts_of(record)
    except SampleSkipped as skip:
        if skip.reason == "documents_and_negatives":  # the columns are the problem: refused as the map-style path
            raise DataError(skip.detail, file=path) from None
        return  # a bad first sample is counted like any other; the columns are not the problem
    for side in ("query", "positive"):
        if side not in parts and f"{side}_image" not in parts:
            lists = f", or a list {columns['documents']!r} (data.columns.documents)" if side == "positive" else ""
            raise RecipeError(f"data.columns.{side}", f"the first sample of {path} has no {side} (looked for "
                                                      f"{columns[side]!r} and {columns[side + '_image']!r}{lists}; it "
                                                      f"has {_field_names(record)}); map yours with "
                                                      f"data.columns.{side}=<name>")
    for part, why in required.items():  # a column the loss reads: absent from the first sample, absent throughout
        if part not in parts:
            raise RecipeError(f"data.columns.{part}", f"the first sample of {path} has no {part} (looked for "
                                                      f"{columns[part]!r}; it has {_field_names(record)}); {why}: "
                                                      f"map yours with data.columns.{part}=<name>")


def _field_names(record: RawRecord) -> list[str]:
    """A sample's field names, a tar sample's `.json` keys as `json:name`."""
    fields = sorted(name for name in record.fields if name != "__key__")
    if "json" in record.fields:
        try:
            fields += [f"json:{name}" for name in json.loads(record.fields["json"])]
        except ValueError:
            pass
    return fields


def check_stream_recipe(data_cfg: "DataConfig", max_steps: int | None, required: Mapping[str, str] | None = None,
                        ) -> None:
    """Before any model is built: the shards exist, their reader is installed, the first sample has the parts the
    loss reads (`required`: part -> what needs it), and the schedule can be sized."""
    backend, shards = open_stream(data_cfg, required)
    unknown = [shard.path for shard in shards if shard.num_samples is None]
    if unknown and max_steps is None:
        raise RecipeError("max_steps", f"is required to stream data.train without a {SIZES_FILE} that gives the "
                                       f"size of every shard ({len(unknown)} of {len(shards)} unknown, e.g. "
                                       f"{unknown[0]!r}); set max_steps, or write the index with "
                                       f"`vembed data index {os.path.dirname(unknown[0])}`")


# --- held-out splits in shards --------------------------------------------------------------------------------------


def held_out_shard_splits(data_cfg: "DataConfig") -> list[str]:
    """The held-out splits (validation, test) that name tar shards, checked: the shards exist, webdataset is there."""
    splits = [split for split in ("validation", "test") if names_tar_shards(getattr(data_cfg, split))]
    for split in splits:
        backend, _ = find_shards(data_cfg, split)
        require_backend(backend)
    return splits


def read_held_out_shards(data_cfg: "DataConfig", split: str,
                         max_images_per_side: int | None) -> tuple[list[Example], StreamReport]:
    """A held-out split given as tar shards (img2dataset writes its validation split so), read for evaluation like
    a JSONL split: the first usable samples in shard order (the same ones every evaluation), at most
    `data.eval_max_samples` (unset: SHARD_EVAL_MAX_SAMPLES, as the split is read whole). Images are checked once and
    kept compressed until encoded. Bad samples and broken shards are skipped and counted as in training."""
    backend, paths = find_shards(data_cfg, split)
    limit = data_cfg.eval_max_samples or SHARD_EVAL_MAX_SAMPLES
    decoder = SampleDecoder(data_cfg.columns.model_dump(), data_cfg.image_root, 0, max_images_per_side,
                            keep_encoded=True)
    shards = [Shard(path, size) for path, size in zip(paths, read_sizes(paths))]
    position, examples = SlotPosition(0), []
    for shard in shards:
        errors: list[Exception] = []
        read = 0
        for record in READERS[backend]([shard.path], lambda file, exn: errors.append(exn)):
            read += 1
            position.drawn += 1
            example = decoder(record, position)
            if example is not None:
                examples.append(example)
            if len(examples) == limit:
                break
        else:  # read to its end: did it give what it should?
            broken = broken_shard(shard, read, errors)
            if broken is not None:
                position.skip_shard(broken)
        if len(examples) == limit:
            break
    sizes = [shard.num_samples for shard in shards]
    report = StreamReport(split=split, files=paths, backend=backend,
                          planned_samples=None if None in sizes else sum(sizes))
    report.merge_positions(0, [position])
    report.check_bad_fraction(data_cfg.max_bad_fraction, epoch_done=True)
    return examples, report


# --- the shard index -----------------------------------------------------------------------------------------------


def index_shards(paths: Sequence[str]) -> dict[str, dict[str, int]]:
    """Count the samples of each shard, from img2dataset's `_stats.json` where there is one, else by reading the
    shard once; returns {directory: {file name: count}} for sizes.json."""
    counts: dict[str, dict[str, int]] = {}
    backend = "webdataset" if all(p.endswith(TAR_EXTENSION) for p in paths) else "datasets"
    errors: list[str] = []
    for path in paths:
        number = stats_size(path)
        if number is None:
            number = sum(1 for _ in READERS[backend]([path], lambda file, exn: errors.append(f"{file}: {exn}")))
        if errors:
            raise DataError(f"cannot read: {errors[0]}", file=path)
        directory, name = os.path.split(os.path.abspath(path))
        counts.setdefault(directory, {})[name] = number
    return counts


def write_sizes(counts: dict[str, dict[str, int]]) -> list[str]:
    """Merge counts into each directory's sizes.json (atomically); returns the files written."""
    written = []
    for directory, sizes in counts.items():
        path = os.path.join(directory, SIZES_FILE)
        merged = json.loads(open(path).read()) if os.path.isfile(path) else {}
        merged.update(sizes)
        tmp = path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(dict(sorted(merged.items())), handle, indent=1)
        os.replace(tmp, path)
        written.append(path)
    return written
