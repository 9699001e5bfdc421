"""What a log line of the loop reports, summed over the micro-batches since the previous one: the loss (each named
source's too), the padding shares of the text sides, samples/s, and the speed figures of throughput.py; and, apart
from the line, every optimizer step's own loss since the previous line, unrounded (`metrics.json`'s `step_losses`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.training.throughput import ThroughputMeter


class LogMeter:
    """Loss and throughput since the last log line; the loss stays on the device until it is logged (no host sync
    per step). With named sources, also the loss of each source's batches. The loop calls `end_step` at each
    optimizer step, so each step's loss is kept apart too, handed over (`take_step_records`) with each log line and
    before each checkpoint."""

    def __init__(self, samples_per_batch: int, throughput: "ThroughputMeter", sources: list[str] | None = None,
                 length_chunks: int = 1):
        self.samples_per_batch = samples_per_batch
        self.throughput = throughput
        self.sources = {name: number for number, name in enumerate(sources or [])}
        self.length_chunks = length_chunks
        self.reset()

    def reset(self) -> None:
        self.started, self.samples, self.batches = time.perf_counter(), 0, 0
        self.loss_sum: torch.Tensor | float = 0.0
        self.source_sums: list[torch.Tensor | float] = [0.0] * len(self.sources)
        self.source_batches = [0] * len(self.sources)
        self.padding: torch.Tensor | None = None  # attended tokens, positions padded as one forward, as chunks
        self.step_sum: torch.Tensor | float = 0.0  # the micro-batch losses of the optimizer step in progress
        self.step_batches = 0
        self.step_losses: list[torch.Tensor] = []  # each finished step's mean micro-batch loss, on the device
        self.throughput.reset()

    def add(self, loss: torch.Tensor, batch: dict[str, Any]) -> None:
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.step_sum = self.step_sum + loss.detach().float()
        self.step_batches += 1
        number = self.sources.get(batch.get("source"))
        if number is not None:
            self.source_sums[number] = self.source_sums[number] + loss.detach().float()
            self.source_batches[number] += 1
        self.throughput.add(batch)
        self._add_padding(batch)
        self.batches += 1
        self.samples += self.samples_per_batch

    def end_step(self) -> None:
        """Close an optimizer step: the mean loss of its micro-batches joins the window's per-step losses."""
        self.step_losses.append(torch.as_tensor(self.step_sum) / max(self.step_batches, 1))
        self.step_sum, self.step_batches = 0.0, 0

    def take_step_records(self, accelerator: "Accelerator", last_step: int) -> list[dict[str, float]]:
        """`{"step", "loss"}` for every optimizer step since the last call (or reset), the last of them `last_step`:
        the loss at full float32 precision, averaged over ranks (one collective for them all: call it on every
        rank). They are handed over once: the next call starts after `last_step`."""
        if not self.step_losses:
            return []
        stacked = torch.stack([torch.as_tensor(loss, device=accelerator.device) for loss in self.step_losses])
        self.step_losses = []
        losses = accelerator.reduce(stacked, "mean").tolist()
        first = last_step - len(losses) + 1
        return [{"step": first + number, "loss": loss} for number, loss in enumerate(losses)]

    def source_losses(self, accelerator: "Accelerator") -> dict[str, float]:
        """`loss/<source>`: the mean loss of each source's batches in the window, averaged over ranks."""
        if not self.sources:
            return {}
        sums = torch.stack([torch.as_tensor(value, device=accelerator.device, dtype=torch.float32)
                            for value in self.source_sums])
        means = accelerator.reduce(sums, "mean").tolist()
        return {f"loss/{name}": means[number] / self.source_batches[number]
                for name, number in self.sources.items() if self.source_batches[number]}

    def _add_padding(self, batch: dict[str, Any]) -> None:
        from vembed.models.batch import TEXT_INDEX
        from vembed.models.length_chunks import padding_counts

        for side in ("query", "positive", "negative"):
            inputs = batch.get(side)
            if isinstance(inputs, dict) and TEXT_INDEX in inputs and "attention_mask" in inputs:
                counts = padding_counts(inputs["attention_mask"], self.length_chunks)
                self.padding = counts if self.padding is None else self.padding + counts

    def padding_record(self, accelerator: "Accelerator") -> dict[str, float]:
        """`padding`: the share of text token positions that were padding in one padded forward per side;
        `padding_chunked`: with the length-aware chunks the step ran (summed over ranks)."""
        if self.padding is None:
            return {}
        attended, padded, chunked = accelerator.reduce(self.padding.float(), "sum").tolist()
        return {"padding": 1 - attended / max(padded, 1), "padding_chunked": 1 - attended / max(chunked, 1)}

    def record(self, accelerator: "Accelerator", step: int, lr: float) -> dict[str, float]:
        """The log line of optimizer step `step`, on every rank (its reductions are collectives): the loss averaged
        over ranks, each named source's, the padding shares, `lr`, and the speed figures (tokens/s, peak memory, MFU).
        The caller resets the meter once the line is written."""
        return {
            "step": step,
            "loss": accelerator.reduce(self.mean_loss(accelerator.device), "mean").item(),  # averaged over ranks
            **self.source_losses(accelerator),  # every rank drew the same sources, so the reduce lines up
            **self.padding_record(accelerator),  # padding shares of the text sides (length-aware encoding)
            "lr": lr,
            "samples_per_second": self.samples_per_second(),
            **self.throughput_record(),  # tokens/s, peak memory, MFU
        }

    def mean_loss(self, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(self.loss_sum, device=device) / max(self.batches, 1)

    def samples_per_second(self) -> float:
        return self.samples / max(time.perf_counter() - self.started, 1e-9)

    def throughput_record(self) -> dict[str, float]:
        return self.throughput.record(time.perf_counter() - self.started)
