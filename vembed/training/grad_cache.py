"""GradCache (Gao et al., 2021): the gradient of one large contrastive batch with the activation memory of one chunk.

Why our own: the only PyPI package (`gradcache` 0.0.1, 2022) does not import as packaged, uses the deprecated
`torch.cuda.amp` and calls `backward` itself, which bypasses the accelerator (loss scaling, accumulation, DeepSpeed).

One optimizer micro-step, for a per-device batch split into chunks of `gradient_cache_chunk_size` samples:
1. every chunk of every side (query, positive, hard negatives) is encoded without a graph; the RNG state (CPU and the
   accelerator device) is captured before each chunk;
2. the loss runs on the detached embeddings of the whole batch (gathered across ranks inside the loss, as usual) and
   its gradient with respect to those embeddings is cached;
3. each chunk is encoded again under its captured RNG state (same dropout masks) and `(embedding * cached_gradient)`
   is backpropagated through the accelerator. Every chunk but the last runs under `no_sync`; the last pass re-encodes
   the final chunk of every side, adds the loss on the detached embeddings (which gives a learnable temperature or
   bias its gradient) and touches every trainable parameter, so DDP's one all-reduce covers everything exactly once.

Every pass that builds a graph runs inside the wrapped objective's forward (`model(run_inside=fn)`), so DDP (and any
wrapper) sees it; what those passes compute lives here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from vembed.models.length_chunks import in_batch_order, is_text_only, select_rows, trim_padding
from vembed.models.token_vectors import cat_tokens, pad_tokens

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.tasks.contrastive import ContrastiveObjective
    from vembed.planning import GradientCacheChoice

SIDES = ("query", "positive", "negative")  # the collated batch's sides, in the order chunks are encoded


class RngState:
    """The CPU generator and the accelerator device's generator, captured so a forward can be replayed exactly."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accel = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Generators start from the captured state inside; the global streams are restored on exit, so a replay
        consumes no randomness from the run."""
        devices = [self.device] if self.accel is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu)
            if self.accel is not None:
                torch.get_device_module(self.device.type).set_rng_state(self.accel, self.device)
            yield


@dataclass(eq=False)
class Chunk:
    """Rows of one side (`rows`, or `start:stop` when None): their inputs, the RNG state of their first forward, and
    the cached gradient."""

    side: str
    start: int
    stop: int
    inputs: dict[str, torch.Tensor]
    rng: RngState
    rows: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    def of(self, batch_rows: torch.Tensor) -> torch.Tensor:
        """This chunk's rows of a tensor in batch order."""
        if self.rows is None:
            return batch_rows[self.start : self.stop]
        return batch_rows.index_select(0, self.rows.to(batch_rows.device))


def chunk_bounds(num_rows: int, chunk_size: int) -> list[tuple[int, int]]:
    """`[(0, c), (c, 2c), ...]` covering `num_rows`; the last chunk may be shorter."""
    return [(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]


class GradCacheStep:
    """Forward and backward of one micro-batch under GradCache; returns the detached loss, like a plain step."""

    def __init__(self, accelerator: "Accelerator", model: torch.nn.Module, chunk_size: int):
        self.accelerator = accelerator
        self.model = model  # the prepared (possibly DDP-wrapped) objective: every pass with a graph goes through it
        self.chunk_size = chunk_size

    @property
    def objective(self) -> "ContrastiveObjective":
        # DDP keeps the module in `.module`; accelerate's unwrap_model would import deepspeed (seconds) to check for it
        return getattr(self.model, "module", self.model)

    def __call__(self, batch: dict[str, Any]) -> torch.Tensor:
        acc = self.accelerator
        chunks, embeddings = self._encode_without_graph(batch)

        # 2. the loss on the whole batch's detached embeddings; cache d(loss)/d(embeddings)
        leaves = {side: embedded.detach().requires_grad_() for side, embedded in embeddings.items()}
        query, positive, negatives = self.objective.shape_embeddings(
            leaves["query"], leaves["positive"], leaves.get("negative"), int(batch.get("num_negatives") or 0)
        )
        inputs = self.objective.loss_inputs(batch)  # labels, scores, a guide's embeddings: once per batch
        with acc.autocast():
            loss = self.objective.loss(query, positive, negatives, **inputs)
        # A side the loss does not read (hard negatives under a pair loss) gets a zero gradient.
        found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = {side: torch.zeros_like(leaf) if grad is None else grad
                 for (side, leaf), grad in zip(leaves.items(), found)}
        for chunk in chunks:
            chunk.grad = chunk.of(grads[chunk.side])

        # 3. replay every chunk under its RNG state and backpropagate its cached gradient
        final = list({chunk.side: chunk for chunk in chunks}.values())  # the last chunk of each side
        for chunk in chunks:
            if chunk not in final:
                with acc.no_sync(self.model):
                    acc.backward(self.model(run_inside=lambda objective, c=chunk: _replayed(objective, c)))
        detached = tuple(None if t is None else t.detach() for t in (query, positive, negatives))
        acc.backward(self.model(run_inside=lambda objective: _last_pass(objective, final, detached, inputs)))
        return loss.detach()

    @torch.no_grad()
    def _encode_without_graph(self, batch: dict[str, Any]) -> tuple[list[Chunk], dict[str, torch.Tensor]]:
        """Every side's chunks and its embeddings in batch order. With length-aware encoding (`length_chunks` > 1),
        a text side's chunks are cut from its rows sorted by length, so each chunk is padded only to texts of about
        its own length; otherwise chunks are consecutive rows."""
        acc, adapter = self.accelerator, self.objective.adapter
        by_length = getattr(self.objective, "length_chunks", 1) > 1
        chunks: list[Chunk] = []
        embeddings: dict[str, torch.Tensor] = {}
        for side in SIDES:
            inputs = batch.get(side)
            if not inputs:
                continue
            order = None
            if by_length and "attention_mask" in inputs and is_text_only(inputs):
                order = torch.argsort(inputs["attention_mask"].sum(dim=1), stable=True)
            parts = []
            for start, stop in chunk_bounds(adapter.num_sides(inputs), self.chunk_size):
                rows = None if order is None else order[start:stop]
                part = adapter.slice_batch(inputs, start, stop) if rows is None else select_rows(inputs, rows)
                if adapter.length_chunking:  # each chunk padded only to its own longest text
                    part = trim_padding(part)
                chunks.append(Chunk(side, start, stop, part, RngState(acc.device), rows))
                with acc.autocast():
                    parts.append(adapter(part))
            embedded = cat_tokens(parts)  # token vectors (multi_vector): padded to the side's longest chunk
            embeddings[side] = embedded if order is None else in_batch_order(embedded, order)
        return chunks, embeddings


def _replayed(objective: "ContrastiveObjective", chunk: Chunk) -> torch.Tensor:
    """The surrogate whose gradient through the encoder is the cached one: (embedding · cached gradient)."""
    with chunk.rng.replay():
        embedding = objective.adapter(chunk.inputs)
    if embedding.dim() == 3:  # token vectors: the chunk is padded to its own longest row, the cached gradient wider
        embedding = pad_tokens(embedding, chunk.grad.shape[1])
    return (embedding.float() * chunk.grad.float()).sum()


def _last_pass(objective: "ContrastiveObjective", final: list[Chunk],
               detached: tuple[torch.Tensor | None, ...], inputs: dict[str, Any]) -> torch.Tensor:
    """The synced pass: the final chunk of every side; the loss on constant embeddings, which reaches only the loss's
    own parameters (temperature, bias); and a zero-weighted touch of every trainable parameter, which puts all of them
    in this pass's graph, so DDP all-reduces each exactly once, including towers that only earlier chunks used."""
    surrogate = sum(_replayed(objective, chunk) for chunk in final)
    surrogate = surrogate + objective.loss(*detached, **inputs)
    return surrogate + sum(p.view(-1)[0] for p in objective.parameters() if p.requires_grad) * 0.0


def build_train_step(accelerator: "Accelerator", model: torch.nn.Module,
                     choice: "GradientCacheChoice") -> Callable[[dict[str, Any]], torch.Tensor]:
    """`step(batch) -> detached loss`: forward and backward of one micro-batch, through the accelerator: plain, or
    GradCache's chunked passes (the launch plan has refused GradCache where it cannot run)."""
    if choice.enabled:
        return GradCacheStep(accelerator, model, choice.chunk_size)

    def plain_step(batch: dict[str, Any]) -> torch.Tensor:
        loss = model(batch)
        accelerator.backward(loss)
        return loss.detach()

    return plain_step
