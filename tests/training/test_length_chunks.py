"""Length-aware encoding (`length_chunks`): texts encoded in length-sorted chunks, each padded only to its longest
row, give the step one padded forward gives: the same embeddings in batch order, loss and gradients (dropout off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from one_step import one_step as _step
from one_step import relative_difference as _relative
from one_step import two_rank_gradients

from vembed.components import recipe_from_dict

BATCH = 8


@pytest.fixture
def uneven_texts(tmp_path, tiny_tokenizer_dir) -> dict:
    """Text pairs whose lengths spread from 2 to ~25 tokens, with a hard negative; a tiny BERT without dropout."""
    words = "red green blue square circle shape small large bright dark".split()
    rows = []
    for i in range(16):
        length = 1 + (i * 7) % 23
        rows.append({"query": " ".join(words[(i + j) % 10] for j in range(length)),
                     "positive": " ".join(words[(i * 3 + j) % 10] for j in range(1 + (i * 5) % 17)),
                     "negatives": [" ".join(words[j % 10] for j in range(1 + i % 4))]})
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "model_type": "text", "pooling": "mean", "tokenizer_name": tiny_tokenizer_dir,
        "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "data": {"train": str(path)}, "output_dir": str(tmp_path / "run"), "batch_size": BATCH, "seed": 0,
        "eval_before_training": False, "learnable_temperature": True,
    }


def test_length_sorted_chunks_give_the_padded_step(uneven_texts):
    rows = list(range(BATCH))
    padded, padded_loss, padded_query = _step(uneven_texts, rows)
    chunked, chunked_loss, chunked_query = _step(dict(uneven_texts, length_chunks=3), rows)
    assert torch.allclose(chunked_query, padded_query, atol=1e-5), "embeddings not back in batch order"
    assert abs(chunked_loss - padded_loss) <= 1e-5 * abs(padded_loss)
    assert _relative(chunked, padded) <= 1e-5


def test_length_sorted_chunks_of_colbert_token_vectors_give_the_padded_step(uneven_texts, mask_tokenizer_dir):
    # token vectors of chunks padded to different widths are put back together (zero-padded) in batch order
    raw = dict(uneven_texts, tokenizer_name=mask_tokenizer_dir, embedding="multi_vector", multi_vector_dim=16,
               query_length=24, loss_type="late_interaction")
    rows = list(range(BATCH))
    padded, padded_loss, _ = _step(raw, rows)
    chunked, chunked_loss, _ = _step(dict(raw, length_chunks=3), rows)
    assert abs(chunked_loss - padded_loss) <= 1e-5 * abs(padded_loss)
    assert _relative(chunked, padded) <= 1e-5


def test_chunks_cut_the_padding_they_report(uneven_texts):
    from vembed.models.length_chunks import chunk_rows, padding_counts, trim_padding

    mask = torch.zeros(6, 10, dtype=torch.long)
    for row, length in enumerate([9, 2, 5, 3, 8, 1]):
        mask[row, :length] = 1
    attended, one_forward, chunked = padding_counts(mask, 2).tolist()
    assert (attended, one_forward) == (28, 60)
    assert chunked == 3 * 3 + 3 * 9  # sorted lengths 1 2 3 | 5 8 9: each chunk padded to its own longest
    assert [sorted(r.tolist()) for r in chunk_rows(mask, 2)] == [[1, 3, 5], [0, 2, 4]]
    trimmed = trim_padding({"input_ids": torch.ones(6, 10), "attention_mask": mask})
    assert trimmed["input_ids"].shape == (6, 9)  # the column no row attends is cut


def test_chunks_encode_only_the_positions_the_loop_reports(uneven_texts):
    """Measured from what the adapter's encode is given in a training step (issue 23): each length-sorted chunk
    trimmed to its longest row, as many positions as `padding_counts` (what the loop logs) says, fewer than one
    padded forward."""
    from accelerate.utils import send_to_device

    from vembed.models.length_chunks import padding_counts
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(dict(uneven_texts, length_chunks=3)))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(BATCH)]),
                           trainer.accelerator.device)
    adapter = trainer.accelerator.unwrap_model(trainer.model).adapter
    encoded, inner = [], adapter.encode
    adapter.encode = lambda inputs: encoded.append(inputs["attention_mask"].numel()) or inner(inputs)
    trainer.train_step(batch)
    masks = [batch[side]["attention_mask"] for side in ("query", "positive", "negative")]
    assert len(encoded) == 3 * 3  # three chunks per side
    assert sum(encoded) == sum(int(padding_counts(mask, 3)[2]) for mask in masks)
    assert sum(encoded) < sum(mask.numel() for mask in masks)


def test_the_loop_logs_padding_before_and_after(uneven_texts):
    from vembed.training.loop import Trainer

    result = Trainer(recipe_from_dict(dict(uneven_texts, length_chunks=4, max_steps=2, logging_steps=1,
                                          save_steps=None))).run()
    record = result.state.loss_history[-1]
    assert 0 < record["padding_chunked"] < record["padding"] < 1


def test_gradient_cache_chunks_cut_to_their_longest_text_equal_the_padded_step(uneven_texts):
    rows = list(range(BATCH))
    padded, _, _ = _step(uneven_texts, rows)
    cached, _, _ = _step(dict(uneven_texts, use_gradient_cache=True, gradient_cache_chunk_size=3), rows)
    assert _relative(cached, padded) <= 1e-5


def _chunk_positions(raw: dict, rows: list[int]) -> tuple[int, int]:
    """(token positions the GradCache chunks of one batch encode, the least any cut into chunks of that size can:
    each side's rows sorted by length, each chunk padded to its own longest)."""
    from accelerate.utils import send_to_device

    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]), trainer.accelerator.device)
    chunks, _ = trainer.train_step._encode_without_graph(batch)
    least = 0
    for side in ("query", "positive", "negative"):
        lengths = batch[side]["attention_mask"].sum(dim=1).sort().values
        least += sum(len(part) * int(part.max()) for part in lengths.split(raw["gradient_cache_chunk_size"]))
    return sum(chunk.inputs["attention_mask"].numel() for chunk in chunks), least


def test_gradient_cache_chunks_formed_by_length_equal_the_padded_step_with_less_padding(uneven_texts):
    rows = list(range(BATCH))
    padded, padded_loss, _ = _step(uneven_texts, rows)
    cached = dict(uneven_texts, use_gradient_cache=True, gradient_cache_chunk_size=3)
    by_length, loss, _ = _step(dict(cached, length_chunks=2), rows)
    assert abs(loss - padded_loss) <= 1e-5 * abs(padded_loss)
    assert _relative(by_length, padded) <= 1e-5
    # Chunks cut from length-sorted rows encode the least positions; consecutive rows encode more.
    sorted_positions, least = _chunk_positions(dict(cached, length_chunks=2), rows)
    consecutive_positions, _ = _chunk_positions(cached, rows)
    assert sorted_positions == least < consecutive_positions


@pytest.mark.slow
@pytest.mark.parametrize("grad_cache", [{}, {"use_gradient_cache": True, "gradient_cache_chunk_size": 2}],
                         ids=["plain", "gradcache-by-length"])
def test_two_ranks_with_length_chunks_equal_one_process_on_the_whole_batch(uneven_texts, tmp_path, grad_cache):
    raw = dict(uneven_texts, batch_size=BATCH // 2, length_chunks=2, **grad_cache)
    ddp = two_rank_gradients(raw, tmp_path, BATCH)
    one, _, _ = _step(dict(uneven_texts, batch_size=BATCH), list(range(BATCH)))  # one padded forward per side
    assert _relative(ddp, one) <= 1e-5


# --- with dropout on: what holds (docs/guides/training.md's recipe table, recipe.py's `length_chunks`) ---
# A chunk draws its dropout masks from the run's generator in its own order, so a chunked step is not the padded
# step: it is another draw of the same distribution. What holds instead is pinned here.

DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


def _with_dropout(raw: dict, negatives: bool = True) -> dict:
    """`raw` with BERT's released dropout (0.1 on hidden states and attention probabilities); without the hard
    negatives when asked (a pair batch: query then positive side, as GradCache encodes them)."""
    raw = dict(raw, model_config={**raw["model_config"], **DROPOUT})
    if not negatives:
        path = Path(raw["data"]["train"])
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        pairs = path.with_name("pairs_only.jsonl")
        pairs.write_text("\n".join(json.dumps({"query": r["query"], "positive": r["positive"]}) for r in rows))
        raw["data"] = {"train": str(pairs)}
    return raw


def _train_step(raw: dict) -> tuple[dict[str, torch.Tensor], float]:
    """Gradients and loss of the first training step on the first batch, nothing drawn before it but the seed."""
    from accelerate.utils import send_to_device

    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(BATCH)]),
                           trainer.accelerator.device)
    loss = trainer.train_step(batch)
    objective = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.grad.detach().clone() for n, p in objective.named_parameters() if p.grad is not None}, loss.item()


def test_with_dropout_a_chunked_step_is_another_draw_and_the_same_one_every_time(uneven_texts):
    raw = _with_dropout(uneven_texts)
    padded, padded_loss = _train_step(raw)
    chunked, chunked_loss = _train_step(dict(raw, length_chunks=3))
    again, again_loss = _train_step(dict(raw, length_chunks=3))
    assert chunked_loss == again_loss and all(torch.equal(again[n], g) for n, g in chunked.items())  # given the seed
    assert _relative(chunked, padded) > 1e-3, "chunks drew the padded forward's masks: update the docs' claim"
    no_dropout, _ = _train_step(dict(uneven_texts, length_chunks=3))
    assert _relative(chunked, no_dropout) > 1e-3, "dropout is not on in this test"


def test_with_dropout_gradient_cache_by_length_replays_each_chunk_masks_exactly(uneven_texts):
    """GradCache re-encodes each chunk under the RNG state of its first forward, so with dropout on its gradient is
    that of the loss it reports: equal (1e-5) to a plain step that draws the same masks, i.e. `length_chunks` cutting
    the same length-sorted chunks in the same order (2 chunks of 4 rows here, query side then positive side)."""
    raw = _with_dropout(uneven_texts, negatives=False)
    plain, plain_loss = _train_step(dict(raw, length_chunks=2))
    cached, cached_loss = _train_step(dict(raw, length_chunks=2, use_gradient_cache=True,
                                           gradient_cache_chunk_size=BATCH // 2))
    assert abs(cached_loss - plain_loss) <= 1e-5 * abs(plain_loss)
    assert _relative(cached, plain) <= 1e-5


def test_with_dropout_a_chunked_run_resumes_to_the_same_weights(uneven_texts, tmp_path):
    from interrupts import stop_after_checkpoint
    from safetensors.torch import load_file

    from vembed.training.loop import Trainer

    raw = dict(_with_dropout(uneven_texts), length_chunks=3, max_steps=4, epochs=2, save_steps=2, logging_steps=1)

    def final_weights(out: Path) -> dict[str, torch.Tensor]:
        Trainer(recipe_from_dict(dict(raw, output_dir=str(out), resume_from="auto"))).run()
        return {f"{f.name}:{k}": v for f in sorted((out / "final").rglob("*.safetensors"))
                for k, v in load_file(str(f)).items()}

    expected = final_weights(tmp_path / "straight")
    stop_after_checkpoint(lambda: Trainer(recipe_from_dict(dict(raw, output_dir=str(tmp_path / "cut")))).run(), 2)
    resumed = final_weights(tmp_path / "cut")
    assert expected.keys() == resumed.keys() and expected
    assert all(torch.equal(resumed[k], v) for k, v in expected.items())
