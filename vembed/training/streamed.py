"""The loop's side of streamed data: one DataLoader per epoch over a `ShardStream`, all ranks stopping together, and the
stream position that checkpoints store.

Ranks stop together: batches are taken in groups of `gradient_accumulation_steps` (one optimizer step); before a group
is trained, every rank says whether it has one (a 1-element all-reduce, once per optimizer step), and the epoch ends
on every rank as soon as one has not. Shard sizes from `sizes.json` plan how many groups that is (the schedule's
length); the plan is also a cap, so an index that undercounts cannot stretch the schedule. Corrupt samples can only
end an epoch earlier than planned; the run then says so at the end.

Position: each batch comes with its slot's position; the last one per slot, and which slot came last, is this rank's
position. `state()` gathers every rank's into the JSON stored in trainer_state.json; `epoch_batches` resumes from it:
every slot replays to its position, and the DataLoader's round-robin restarts at the slot after the last one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vembed.data.streaming import ShardStream, SlotPosition, StreamLayout, StreamReport
from vembed.errors import DataError, RecipeError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe


def _unchanged(item: Any) -> Any:
    # DataLoader(batch_size=None) would convert the (position, batch) pair; it is already what the loop wants.
    return item


class StreamedSchedule(NamedTuple):
    """The length of a streamed run, under the names the loop gives every run's."""

    batches_per_epoch: int | None  # per rank, in the first epoch; None without an index (max_steps sizes the run)
    steps_per_epoch: int | None
    total_steps: int
    num_epochs: int | None  # None: until max_steps


class StreamedEpochs:
    """Feeds the loop batches of a `ShardStream`, epoch by epoch, on this rank."""

    def __init__(self, stream: ShardStream, report: StreamReport, recipe: "Recipe", accelerator: "Accelerator"):
        self.stream, self.report, self.recipe, self.accelerator = stream, report, recipe, accelerator
        self.num_workers = recipe.data.num_workers
        self.group = recipe.gradient_accumulation_steps
        self.layout = StreamLayout(world=accelerator.num_processes, rank=accelerator.process_index,
                                   workers=max(1, self.num_workers))
        stream.set_layout(self.layout)
        shards = len(stream.shards)
        if shards < self.layout.slots:
            raise DataError(f"{shards} shard(s) for {self.layout.world} rank(s) x {self.layout.workers} reader(s): "
                            "every reader needs at least one; split the data into more files or lower "
                            "data.num_workers", file=stream.files[0])
        self.epoch = -1
        self.positions: dict[int, SlotPosition] = {}
        self.last_slot: int | None = None
        self.ran_short: list[tuple[int, int, int]] = []  # (epoch, batches taken, planned) of epochs that ended early

    # --- the plan --------------------------------------------------------------------------------------------------
    def schedule(self) -> StreamedSchedule:
        """The schedule of the run: `max_steps`, or the epochs' lengths planned from the shard index (epochs
        differ a little: each deals the shards anew). Streamed epochs always end on an optimizer step. Records the
        plan in the data report."""
        recipe = self.recipe
        epochs = 1 if recipe.max_steps is not None else recipe.epochs
        planned = [self.planned_batches(epoch) for epoch in range(epochs)]
        if 0 in planned:
            layout = self.layout
            raise DataError(
                f"{self.report.planned_samples} samples in {len(self.stream.shards)} shards give some rank no "
                f"full optimizer step of {recipe.gradient_accumulation_steps} batch(es) of {recipe.batch_size} in "
                f"epoch {planned.index(0)} ({layout.world} rank(s) x {layout.workers} reader(s), each batching its "
                "own shards); lower batch_size or data.num_workers, or add shards", file=self.stream.files[0])
        self.report.batches_per_rank = planned[0]
        if planned[0] is not None:
            self.report.unread_per_epoch = [self.unread_samples(epoch) for epoch in range(epochs)]
        return StreamedSchedule(
            batches_per_epoch=planned[0],
            steps_per_epoch=None if planned[0] is None else planned[0] // recipe.gradient_accumulation_steps,
            total_steps=recipe.max_steps or sum(p // recipe.gradient_accumulation_steps for p in planned),
            num_epochs=recipe.epochs if recipe.max_steps is None else None,
        )

    def planned_batches(self, epoch: int) -> int | None:
        """Batches per rank in `epoch` by the shard index, in whole optimizer steps; None without an index."""
        planned = self.stream.planned_batches(epoch)
        return None if planned is None else planned - planned % self.group

    def unread_samples(self, epoch: int) -> int | None:
        """Samples of `epoch` no rank reads by the plan (ranks' surplus over the smallest, readers' incomplete last
        batches, the batches short of a whole optimizer step); None without an index."""
        planned, total = self.planned_batches(epoch), self.stream.planned_samples()
        if planned is None or total is None:
            return None
        return total - self.layout.world * planned * self.stream.batch_size

    # --- one epoch -------------------------------------------------------------------------------------------------
    def epoch_batches(self, epoch: int, taken: int, saved: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
        """The batches of `epoch` still to train, on the device. `taken`: batches this rank already trained in
        `epoch` (from the checkpoint); `saved`: the checkpoint's stream state, or None."""
        from accelerate.utils import send_to_device
        from torch.utils.data import DataLoader

        self._start(epoch, taken, saved)
        planned = self.planned_batches(epoch)
        loader = DataLoader(self.stream, batch_size=None, num_workers=self.num_workers, collate_fn=_unchanged,
                            pin_memory=torch.cuda.is_available(),
                            # Its own generator: starting an iterator draws a seed, and the run's RNG must not
                            # depend on how many iterators a resumed run started.
                            generator=torch.Generator().manual_seed(0))
        iterator = iter(loader)
        try:
            while planned is None or taken + self.group <= planned:
                group = self._next_group(iterator)
                everyone_has_one, skipped = self._exchange(sum(batch is not None for _, batch in group) == self.group)
                limit = self.report.planned_samples
                if limit is not None and skipped > self.recipe.data.max_bad_fraction * limit:
                    self._check_bad_fraction(epoch_done=False)  # cannot pass any more: stop now, on every rank
                if not everyone_has_one:
                    for position, _ in group:  # not trained; their counts still go into the epoch's report
                        self.positions[position["slot"]] = SlotPosition.from_dict(position)
                    break
                for position, batch in group:  # in the DataLoader's order: the last one says where to resume
                    self.positions[position["slot"]] = SlotPosition.from_dict(position)
                    self.last_slot = position["slot"]
                    if batch is not None:
                        taken += 1
                        yield send_to_device(batch, self.accelerator.device)
        finally:
            del iterator  # shuts this epoch's workers down
        if planned is not None and taken < planned:
            self.ran_short.append((epoch, taken, planned))
        self._check_bad_fraction(epoch_done=True)

    def _next_group(self, iterator: Iterator[tuple[dict[str, Any], Any]]) -> list[tuple[dict[str, Any], Any]]:
        """Items up to `group` batches (fewer when the stream runs out), with the end-of-slot items between them."""
        items, batches = [], 0
        while batches < self.group:
            item = next(iterator, None)
            if item is None:
                break
            items.append(item)
            batches += item[1] is not None
        return items

    def _start(self, epoch: int, taken: int, saved: dict[str, Any] | None) -> None:
        self.epoch, self.positions, self.last_slot = epoch, {}, None
        if saved is not None and saved.get("epoch") == epoch and taken:
            self._check_compatible(saved)
            mine = saved["ranks"][self.layout.rank]
            self.positions = {int(p["slot"]): SlotPosition.from_dict(p) for p in mine["positions"]}
            self.last_slot = mine["last_slot"]
        first_worker = 0
        if self.last_slot is not None:
            first_worker = (self.last_slot - self.layout.rank * self.layout.workers + 1) % self.layout.workers
        self.stream.start_epoch(epoch, self.positions, first_worker)

    def _check_compatible(self, saved: dict[str, Any]) -> None:
        was = (saved["world"], saved["workers"], saved["batch_size"], saved["seed"], saved["shuffle_buffer"],
               saved["num_shards"])
        now = (self.layout.world, self.layout.workers, self.stream.batch_size, self.stream.seed,
               self.stream.shuffle_buffer, len(self.stream.shards))
        if was != now:
            names = ("ranks", "readers per rank (data.num_workers, at least 1)", "batch_size", "seed",
                     "data.shuffle_buffer", "shards")
            diff = ", ".join(f"{n} {a} then, {b} now" for n, a, b in zip(names, was, now) if a != b)
            raise RecipeError("resume_from", f"the checkpoint streamed its data differently ({diff}); resume "
                                             "with the launch and data settings it was saved with")

    def _exchange(self, has_group: bool) -> tuple[bool, int]:
        """(whether every rank has a full group, samples skipped so far by all ranks): one all-reduce per group."""
        skipped = sum(sum(p.skipped.values()) for p in self.positions.values())
        if self.layout.world == 1:
            return has_group, skipped
        sums = torch.tensor([0 if has_group else 1, skipped], device=self.accelerator.device)
        missing, skipped = self.accelerator.reduce(sums, "sum").tolist()
        return missing == 0, skipped

    def _check_bad_fraction(self, *, epoch_done: bool) -> None:
        """Entered by every rank at the same point; all see the same gathered counts, so all raise together."""
        self.update_report()
        self.report.check_bad_fraction(self.recipe.data.max_bad_fraction, epoch_done=epoch_done)

    # --- reports and checkpoints -----------------------------------------------------------------------------------
    def _gathered(self) -> list[dict[str, Any]]:
        """Every rank's position (collective)."""
        mine = {"positions": [p.to_dict() for p in sorted(self.positions.values(), key=lambda p: p.slot)],
                "last_slot": self.last_slot}
        if self.layout.world == 1:
            return [mine]
        from accelerate.utils import gather_object

        return gather_object([mine])

    def update_report(self) -> None:
        """The report's counts for the epoch in progress, over every rank (collective)."""
        ranks = self._gathered()
        self.report.merge_positions(max(self.epoch, 0), [p for rank in ranks for p in rank["positions"]])

    def state(self) -> dict[str, Any]:
        """The stream position of every rank, for trainer_state.json (collective: every rank calls it)."""
        return {"epoch": self.epoch, "world": self.layout.world, "workers": self.layout.workers,
                "batch_size": self.stream.batch_size, "seed": self.stream.seed,
                "shuffle_buffer": self.stream.shuffle_buffer, "num_shards": len(self.stream.shards),
                "ranks": self._gathered()}
