"""Each adapter's FLOPs count (the numerator of MFU) against torch's own operator-level FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vembed.models.flops import matmul_weights


def _counted_by_torch(adapter, inputs) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.encode(inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize("model_type", ["clip", "siglip", "text", "composed"])
def test_forward_flops_match_torch_flop_counter_on_text(build, text_sides, model_type):
    adapter = build(model_type)
    inputs = adapter.preprocess(text_sides)
    ours = float(adapter.forward_flops(inputs))
    # The 2·N·T rule leaves out attention's T² term and counts projections on every token: close, not equal.
    assert ours == pytest.approx(_counted_by_torch(adapter, inputs), rel=0.25)


@pytest.mark.parametrize("model_type", ["clip", "siglip", "composed"])
def test_forward_flops_count_images_by_patches(build, mixed_sides, model_type):
    adapter = build(model_type)
    images = adapter.preprocess([side for side in mixed_sides if side.text is None])
    both = adapter.preprocess(mixed_sides)
    assert float(adapter.forward_flops(images)) == pytest.approx(_counted_by_torch(adapter, images), rel=0.25)
    assert float(adapter.forward_flops(both)) == pytest.approx(_counted_by_torch(adapter, both), rel=0.25)


def test_padding_costs_nothing_and_embedding_tables_are_not_weights(build, text_sides):
    adapter = build("text")
    short = adapter.preprocess(text_sides[:1])
    padded = adapter.preprocess(text_sides)  # the first row is now padded to the longest
    per_token = float(adapter.forward_flops(short)) / int(short["attention_mask"].sum())
    assert float(adapter.forward_flops(padded)) == pytest.approx(per_token * int(padded["attention_mask"].sum()))
    tables = sum(m.weight.numel() for m in adapter.model.modules() if isinstance(m, torch.nn.Embedding))
    assert per_token == 2 * (sum(p.numel() for p in adapter.model.parameters()) - tables)
    assert matmul_weights(adapter.model) * 2 == per_token
