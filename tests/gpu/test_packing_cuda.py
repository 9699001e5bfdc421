"""Packed batches on CUDA (skipped without a GPU): bf16 attention goes through torch's varlen flash kernel, in one
launch per layer, and agrees with each text attended alone (the exact path the CPU tests compare with the padded
forward) to bf16 tolerance, for bidirectional, causal grouped-query and sliding-window attention."""

from __future__ import annotations

import pytest
import torch

from vembed.models import packing

needs_varlen = pytest.mark.skipif(not torch.cuda.is_available() or packing.varlen_attn_function() is None,
                                  reason="needs CUDA and torch.nn.attention.varlen (torch >= 2.10)")
BF16_ATOL = 3e-2  # bf16 has 8 bits of mantissa: outputs of unit scale agree to about 1e-2


@pytest.fixture
def counted_varlen(monkeypatch):
    import functools

    calls = []
    real = packing.varlen_attn_function()

    @functools.wraps(real)  # keeps the kernel's signature, which packing reads to know what this torch's takes
    def counting(*args, **kwargs):
        calls.append(kwargs.get("window_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(packing, "varlen_attn_function", lambda: counting)
    return calls


@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("causal, heads_kv, window", [(False, 4, None), (True, 2, None), (False, 4, 3)],
                         ids=["bidirectional", "causal-gqa", "sliding-window"])
def test_varlen_attention_equals_each_text_alone_in_bf16(counted_varlen, causal, heads_kv, window):
    torch.manual_seed(0)
    lengths = [37, 5, 64, 1, 20]
    total = sum(lengths)
    query = torch.randn(1, 4, total, 32, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, heads_kv, total, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    flash, _ = packing.packed_attention(torch.nn.Module(), query, key, value, None, scaling=32 ** -0.5,
                                        is_causal=causal, cu_seq_lens_q=bounds, max_length_q=max(lengths),
                                        sliding_window=window)
    assert len(counted_varlen) == 1  # one kernel launch for the whole packed row
    reach = -1 if window is None else window - 1
    exact = packing._each_text_alone(query.float(), key.float(), value.float(), bounds, 32 ** -0.5, causal,
                                     heads_kv != 4, reach)
    assert torch.allclose(flash.float(), exact, atol=BF16_ATOL), (flash.float() - exact).abs().max()


@pytest.mark.gpu
@needs_varlen
def test_a_packed_bf16_training_step_on_cuda_is_the_padded_step(counted_varlen, tmp_path, tiny_tokenizer_dir):
    """A tiny BERT trained one step in bf16, packed and padded, from the same weights: the same loss and gradients
    to bf16 tolerance, and the packed step reached the flash kernel."""
    import json

    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    words = "red green blue square circle shape small large bright dark".split()
    rows = [{"query": " ".join(words[(i + j) % 10] for j in range(1 + (i * 7) % 23)),
             "positive": " ".join(words[(i * 3 + j) % 10] for j in range(1 + (i * 5) % 17))} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    raw = {"model_type": "text", "pooling": "mean", "tokenizer_name": tiny_tokenizer_dir,
           "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
           "data": {"train": str(tmp_path / "pairs.jsonl")}, "batch_size": 8, "seed": 0, "mixed_precision": "bf16",
           "eval_before_training": False, "save_steps": None}
    results = []
    for name, extra in (("padded", {}), ("packed", {"packing": True})):
        trainer = Trainer(recipe_from_dict({**raw, **extra, "output_dir": str(tmp_path / name)}))
        trainer.build()
        batch = send_to_device(trainer.collate([trainer.dataset[i] for i in range(8)]), trainer.accelerator.device)
        loss = trainer.train_step(batch).item()
        model = trainer.accelerator.unwrap_model(trainer.model)
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss, grads))
    (padded_loss, padded), (packed_loss, packed) = results
    assert counted_varlen, "the packed step never reached the varlen kernel"
    assert abs(packed_loss - padded_loss) <= 2e-2 * abs(padded_loss)
    assert ((packed - padded).norm() / padded.norm()).item() <= 5e-2
