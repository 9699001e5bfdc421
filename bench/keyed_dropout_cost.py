"""Would chunk-independent dropout be cheap? A measured answer for `length_chunks` (issue 40, item 4).

A length-sorted chunk (vembed/models/length_chunks.py) draws its dropout masks from the global generator in another
order than one padded forward, so with dropout on the two runs differ (equally distributed, not equal). To make them
equal, every mask element must be a function of (step seed, the sequence's batch row, the dropout call, its position
in that sequence) and of nothing the chunking changes: not the padded length, not the row's place in its chunk.

This prototype does that for a BERT (MiniLM-L6 shapes, random weights): every `nn.Dropout` is replaced by one whose
keep/drop decision is a 32-bit integer hash of those keys ("keyed"), so chunked and padded steps give equal losses.
Attention-probability dropout must then run outside the fused kernel (SDPA draws its own mask from the padded
shape), so the keyed run uses eager attention. The script times a training step (two text sides, in-batch softmax
loss, backward) for: SDPA with native dropout (today), eager with native dropout, eager with keyed dropout; each
padded and in 4 length-sorted chunks; and checks the keyed losses agree.

    python bench/keyed_dropout_cost.py [--steps 12] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MASK32 = 0xFFFFFFFF
SEQ_BOUND = 512  # positions are keyed on a fixed grid (max_position_embeddings), never on the padded length


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a 32-bit integer hash, exact in int64 on every device (products keep their low bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


class Keys:
    """The per-row seeds of the batch being encoded and a counter of dropout calls within one forward."""

    row_seeds: torch.Tensor | None = None
    calls = 0


def keyed_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout whose mask depends on (row seed, call index, position in the sequence, feature) only."""
    Keys.calls += 1
    if x.dim() == 3:  # (rows, positions, features)
        _, length, features = x.shape
        pos = torch.arange(length).view(length, 1) * features + torch.arange(features).view(1, features)
    else:  # attention probabilities (rows, heads, positions, positions)
        _, heads, length, _ = x.shape
        h = torch.arange(heads).view(heads, 1, 1)
        i = torch.arange(length).view(1, length, 1)
        j = torch.arange(length).view(1, 1, length)
        pos = (h * SEQ_BOUND + i) * SEQ_BOUND + j
    row = _mix((Keys.row_seeds * 1000003 + Keys.calls) & MASK32).view(-1, *([1] * pos.dim()))
    keep = _mix((row ^ pos.unsqueeze(0)) & MASK32) >= int(p * 2**32)
    return x * keep.to(x.dtype) / (1 - p)


class KeyedDropout(torch.nn.Module):
    """`keyed_dropout` as a module, for the hidden-state dropouts (embeddings, attention output, feed-forward)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(x, self.p) if self.training and self.p > 0 else x


def keyed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention with `keyed_dropout` on the probabilities (registered as "keyed_eager"): the
    fused SDPA kernel draws its own mask from the padded shape, so keyed masks cost the unfused path."""
    weights = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.size(-1) ** -0.5)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
    elif attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    if dropout > 0:
        weights = keyed_dropout(weights, dropout)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def build(attn: str, keyed: bool) -> torch.nn.Module:
    from transformers import AttentionInterface, BertConfig, BertModel
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("keyed_eager", keyed_attention)
    AttentionMaskInterface.register("keyed_eager", eager_mask)  # without it the padding would not be masked

    config = BertConfig(vocab_size=30522, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                        num_attention_heads=12, max_position_embeddings=SEQ_BOUND, attn_implementation=attn)
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False)
    if keyed:
        for name, module in list(model.named_modules()):
            for child, sub in list(module.named_children()):
                if isinstance(sub, torch.nn.Dropout):
                    setattr(module, child, KeyedDropout(sub.p))
    return model.train()


def uneven_batch(batch: int, median: int, sigma: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(batch, generator=gen) * sigma).exp().mul(median).clamp(2, 256).long()
    ids = torch.randint(1000, 30000, (batch, int(lengths.max())), generator=gen)
    mask = (torch.arange(ids.shape[1]).view(1, -1) < lengths.view(-1, 1)).long()
    return ids * mask, mask


def encode(model, ids, mask, seeds, chunks: int) -> torch.Tensor:
    order = torch.argsort(mask.sum(1), stable=True)
    parts, rows = [], []
    for part in order.tensor_split(chunks):
        width = int(mask[part].sum(1).max())
        Keys.row_seeds, Keys.calls = seeds[part], 0
        hidden = model(input_ids=ids[part, :width], attention_mask=mask[part, :width]).last_hidden_state
        m = mask[part, :width].unsqueeze(-1).to(hidden.dtype)
        parts.append((hidden * m).sum(1) / m.sum(1))
        rows.append(part)
    out = torch.cat(parts)
    inverse = torch.empty_like(order)
    inverse[torch.cat(rows)] = torch.arange(len(order))
    return out[inverse]


def step(model, batch, chunks: int, seed: int) -> float:
    (q_ids, q_mask), (d_ids, d_mask) = batch
    torch.manual_seed(seed)
    n = len(q_ids)
    q = encode(model, q_ids, q_mask, torch.arange(n) + seed * 7919, chunks)
    d = encode(model, d_ids, d_mask, torch.arange(n) + seed * 7919 + n, chunks)
    scores = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(d, dim=-1).T / 0.05
    loss = torch.nn.functional.cross_entropy(scores, torch.arange(n))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = (uneven_batch(args.batch, 12, 0.4, 1), uneven_batch(args.batch, 65, 0.7, 2))
    variants = {"sdpa, native dropout": build("sdpa", False), "eager, native dropout": build("eager", False),
                "eager, keyed dropout": build("keyed_eager", True)}
    for model in variants.values():  # warm-up
        step(model, batch, 1, 0), step(model, batch, 4, 0)
    times: dict[tuple[str, int], list[float]] = {(name, c): [] for name in variants for c in (1, 4)}
    losses: dict[tuple[str, int], float] = {}
    for i in range(args.steps):  # interleaved, so a load change hits every variant alike
        for name, model in variants.items():
            for chunks in (1, 4):
                start = time.perf_counter()
                loss = step(model, batch, chunks, seed=1)
                times[(name, chunks)].append(time.perf_counter() - start)
                losses[(name, chunks)] = loss
    base = statistics.median(times[("sdpa, native dropout", 1)])
    for (name, chunks), spent in times.items():
        median = statistics.median(spent)
        print(f"{name:24s} chunks={chunks}  step {median * 1000:7.1f} ms  ({median / base:.2f}x sdpa padded)  "
              f"loss {losses[(name, chunks)]:.6f}")


if __name__ == "__main__":
    main()
