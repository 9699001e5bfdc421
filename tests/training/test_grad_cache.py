"""GradCache exactness: the cached step's gradients equal those of one step on the whole batch.

With dropout on, a chunked forward and a whole-batch forward draw different masks, so "the whole batch" is built
the way GradCache sees it: each side encoded chunk by chunk, with a graph, in the same order and from the same seed,
then ONE loss over all the embeddings and ONE backward. That reference shares nothing with the cached path except
the model; it proves that caching, RNG replay and the surrogate backward change nothing. With dropout off, the
reference is the plain one-forward-per-side step used in training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import run_on_ranks
from tiny_models import TINY_CLIP_CONFIG

from vembed.components import recipe_from_dict
from vembed.models.token_vectors import cat_tokens

BATCH = 8


def _trainer(raw: dict):
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    return trainer


def _batch(trainer, rows: list[int]) -> dict:
    from accelerate.utils import send_to_device

    return send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]), trainer.accelerator.device)


def _grads(trainer) -> dict[str, torch.Tensor]:
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.grad.detach().clone() for n, p in unwrapped.named_parameters() if p.grad is not None}


def _cached_step(raw: dict, rows: list[int], seed: int = 7) -> tuple[dict[str, torch.Tensor], float]:
    trainer = _trainer(raw)
    assert trainer.plan.grad_cache.enabled
    batch = _batch(trainer, rows)
    torch.manual_seed(seed)
    loss = trainer.train_step(batch)
    return _grads(trainer), loss.item()


def _reference_step(raw: dict, rows: list[int], chunk: int | None, seed: int = 7) -> tuple[dict, float]:
    """One loss and one backward over the whole batch; sides encoded in chunks of `chunk` rows (None: whole)."""
    trainer = _trainer(dict(raw, use_gradient_cache=False, gradient_cache_chunk_size=None))
    objective = trainer.accelerator.unwrap_model(trainer.model)
    batch = _batch(trainer, rows)
    torch.manual_seed(seed)
    embedded = {}
    for side in ("query", "positive", "negative"):
        inputs = batch.get(side)
        if not inputs:
            continue
        rows_in_side = objective.adapter.num_sides(inputs)
        step = chunk or rows_in_side
        parts = [objective.adapter.encode(_as_cached(objective.adapter, inputs, s, min(s + step, rows_in_side)))
                 for s in range(0, rows_in_side, step)]
        embedded[side] = cat_tokens(parts)  # token vectors: padded to the longest chunk, as GradCache does
    loss = objective.loss(*objective.shape_embeddings(
        embedded["query"], embedded["positive"], embedded.get("negative"), int(batch.get("num_negatives") or 0)),
        **objective.loss_inputs(batch))
    loss.backward()
    return _grads(trainer), loss.item()


def _as_cached(adapter, inputs: dict, start: int, stop: int) -> dict:
    """Rows `start:stop` of a side as GradCache encodes them: cut to their own longest text where the adapter allows
    (with dropout on, the masks drawn depend on that shape)."""
    from vembed.models.length_chunks import trim_padding

    part = adapter.slice_batch(inputs, start, stop)
    return trim_padding(part) if adapter.length_chunking else part


def _assert_close(actual: dict, reference: dict, tolerance: float = 1e-5) -> float:
    assert actual.keys() == reference.keys()
    ref = torch.cat([g.flatten() for g in reference.values()])
    got = torch.cat([actual[n].flatten() for n in reference])
    relative = ((got - ref).norm() / ref.norm()).item()
    assert relative <= tolerance, f"relative gradient difference {relative:.2e}"
    return relative


def _no_dropout(raw: dict) -> dict:
    config = raw["model_config"]
    towers = {k: {**v, "dropout": 0.0, "attention_dropout": 0.0} for k, v in config.items() if k.endswith("_config")}
    return dict(raw, model_config={**config, **towers})


def _with_attention_dropout(raw: dict) -> dict:
    # transformers' CLIP ignores `dropout`; attention dropout is its only random op, and the RNG replay is under test.
    config = raw["model_config"]
    towers = {k: {**v, "attention_dropout": 0.2} for k, v in config.items() if k.endswith("_config")}
    return dict(raw, model_config={**config, **towers})


@pytest.fixture
def text_pairs(tmp_path, tiny_tokenizer_dir):
    """Text-only pairs with two hard negatives each, and a tiny BERT recipe with dropout on."""
    rows = [{"query": f"question {i} about shape {i % 5}", "positive": f"answer {i}: a shape {i % 5}",
             "negatives": [f"wrong answer {i}", f"another wrong answer {i + 1}"]} for i in range(16)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "model_type": "text", "pooling": "mean", "tokenizer_name": tiny_tokenizer_dir,
        "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32,
                         "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
        "data": {"train": str(path)}, "output_dir": str(tmp_path / "run"), "batch_size": BATCH, "seed": 0,
        "eval_before_training": False, "learnable_temperature": True,
    }


@pytest.mark.parametrize(
    "chunk, settings",
    [
        (4, {}),  # divides the batch; two hard negatives per pair (16 negative rows)
        (3, {}),  # does not divide it: chunks of 3, 3, 2
        (3, {"data_negatives": 0, "learnable_temperature": True}),
        (5, {"mrl_dims": [16, 8], "loss_type": "infonce"}),
        (3, {"loss_type": "siglip", "learnable_temperature": True, "temperature": 0.1}),
    ],
    ids=["clip-chunk4", "clip-chunk3", "clip-no-negatives", "clip-matryoshka", "clip-siglip"],
)
def test_cached_gradients_equal_whole_batch_with_dropout_on(tiny_clip_recipe, chunk, settings):
    # The dummy data's rows carry labels (shape-colour), so same-label in-batch negatives are masked in both paths.
    settings = dict(settings)
    raw = _with_attention_dropout(
        dict(tiny_clip_recipe, batch_size=BATCH, use_gradient_cache=True, gradient_cache_chunk_size=chunk)
    )
    if "data_negatives" in settings:
        raw["data"] = {**raw["data"], "num_hard_negatives": settings.pop("data_negatives")}
    raw.update(settings)
    rows = list(range(BATCH))
    cached, cached_loss = _cached_step(raw, rows)
    reference, reference_loss = _reference_step(raw, rows, chunk)
    assert cached_loss == pytest.approx(reference_loss, rel=1e-6)
    print(f"relative gradient difference: {_assert_close(cached, reference):.2e}")


def test_cached_gradients_equal_whole_batch_for_a_text_adapter(text_pairs):
    raw = dict(text_pairs, use_gradient_cache=True, gradient_cache_chunk_size=3)
    rows = list(range(BATCH))
    cached, _ = _cached_step(raw, rows)
    reference, _ = _reference_step(raw, rows, chunk=3)
    _assert_close(cached, reference)
    assert any(name.startswith("loss.") for name in cached)  # the learnable temperature got its gradient


def _colbert(text_pairs: dict, mask_tokenizer_dir: str) -> dict:
    """text_pairs as ColBERT: expanded queries, documents whose lengths differ from chunk to chunk (so chunks are
    padded to different widths) with punctuation to skip."""
    rows = [{"query": f"question {i}", "positive": f"answer {i}: " + "a shape, " * (i % 4),
             "negatives": ["wrong. " * (1 + i % 3), f"another {i}"]} for i in range(16)]
    path = Path(text_pairs["data"]["train"]).with_name("colbert.jsonl")
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return dict(text_pairs, tokenizer_name=mask_tokenizer_dir, embedding="multi_vector", multi_vector_dim=16,
                query_length=12, loss_type="late_interaction", temperature=0.5, data={"train": str(path)})


def _candidate_lists(text_pairs: dict) -> dict:
    """text_pairs' rows as one candidate list per query with a teacher's scores: {query, documents, scores}."""
    rows = [{"query": f"question {i}",
             "documents": [f"answer {i}: " + "a shape, " * (i % 4), "wrong. " * (1 + i % 3), f"another {i}"],
             "scores": [3.0 - i % 4, 0.5 * (i % 3), -1.0 + i % 2]} for i in range(16)]
    path = Path(text_pairs["data"]["train"]).with_name("lists.jsonl")
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {"train": str(path)}


@pytest.mark.parametrize("loss", ["late_interaction", "late_interaction_pairwise", "late_interaction_distill_kl"])
def test_cached_gradients_equal_whole_batch_for_colbert_token_vectors(text_pairs, mask_tokenizer_dir, loss):
    raw = dict(_colbert(text_pairs, mask_tokenizer_dir), use_gradient_cache=True, gradient_cache_chunk_size=3,
               loss_type=loss)
    if loss != "late_interaction":
        raw["learnable_temperature"] = False
    if loss == "late_interaction_distill_kl":  # teacher scores of each query's candidates, the list shape
        raw["data"] = _candidate_lists(text_pairs)
    rows = list(range(BATCH))
    cached, cached_loss = _cached_step(raw, rows)
    reference, reference_loss = _reference_step(raw, rows, chunk=3)
    assert cached_loss == pytest.approx(reference_loss, rel=1e-6)
    assert reference_loss > 0
    print(f"relative gradient difference: {_assert_close(cached, reference):.2e}")
    assert "adapter.projection.weight" in cached
    assert ("loss._infonce.log_scale" in cached) == (loss == "late_interaction")


@pytest.mark.parametrize("loss", ["infonce", "margin_mse"])
def test_cached_gradients_equal_whole_batch_for_sparse_vectors_with_flops(text_pairs, loss):
    # The FLOPS terms read the whole batch's mean, so they need the whole batch's vectors, which GradCache caches.
    config = {**text_pairs["model_config"], "vocab_size": 300}
    raw = dict(text_pairs, model_config=config, embedding="sparse", pooling="mean", loss_type=loss, temperature=1.0,
               learnable_temperature=False, flops_query_weight=0.05, flops_document_weight=0.03,
               use_gradient_cache=True, gradient_cache_chunk_size=3)
    if loss == "margin_mse":
        rows = [{"query": f"question {i}", "positive": f"answer {i}: a shape {i % 5}", "negatives": [f"wrong {i}"],
                 "teacher": [2.0 - i % 3, 0.5 * (i % 2)]} for i in range(16)]
        path = Path(text_pairs["data"]["train"]).with_name("teacher.jsonl")
        path.write_text("\n".join(json.dumps(r) for r in rows))
        raw["data"] = {"train": str(path), "columns": {"score": "teacher"}}
    rows = list(range(BATCH))
    cached, cached_loss = _cached_step(raw, rows)
    reference, reference_loss = _reference_step(raw, rows, chunk=3)
    assert cached_loss == pytest.approx(reference_loss, rel=1e-6)
    print(f"relative gradient difference: {_assert_close(cached, reference):.2e}")


@pytest.fixture
def scored_text_pairs(text_pairs, tmp_path):
    """The text pairs with a label, a gold score per pair (`gold`) and teacher scores of [positive, negatives]
    (`teacher`); a recipe picks one with data.columns.score."""
    rows = [{"query": f"question {i} about shape {i % 5}", "positive": f"answer {i}: a shape {i % 5}",
             "negatives": [f"wrong answer {i}", f"another wrong answer {i + 1}"], "label": f"shape {i % 3}",
             "gold": (i * 7 % 11) / 10, "teacher": [3.0 - i % 4, 0.5 * (i % 3), -1.0 + i % 2]} for i in range(16)]
    path = tmp_path / "scored.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return dict(text_pairs, data={"train": str(path)})


SCORED_LOSSES = {
    "cosent": ("gold", {}), "angle": ("gold", {}), "cosine_mse": ("gold", {}),
    "triplet": ("gold", {"triplet_margin": 0.5}), "batch_hard_triplet": ("gold", {"triplet_margin": 0.5}),
    "margin_mse": ("teacher", {}), "distill_kl": ("teacher", {"temperature": 0.5}),
    "lists-distill_kl": ("scores", {"temperature": 0.5}),  # read from {query, documents, scores} lines
    "matryoshka-cosent": ("gold", {"mrl_dims": [32, 8]}),
    "gist": ("gold", {"gist_margin": 0.0}),  # the tiny guide scores every pair alike: no margin, or all is masked
    "embedding_mse": ("gold", {}),  # the teacher's vectors: extracted below with another tiny text model
}


@pytest.mark.parametrize("case", list(SCORED_LOSSES))
def test_cached_gradients_equal_whole_batch_for_the_scored_and_triplet_losses(scored_text_pairs, case, tmp_path):
    # Each is computed on the whole batch's embeddings, so GradCache must give the whole-batch gradient.
    column, keys = SCORED_LOSSES[case]
    raw = dict(scored_text_pairs, loss_type=case.split("-")[-1], use_gradient_cache=True, gradient_cache_chunk_size=3,
               learnable_temperature=False, **keys)
    raw["data"] = {**raw["data"], "columns": {"score": column}}
    if case.startswith("lists-"):
        raw["data"] = _candidate_lists(scored_text_pairs)
    if case == "gist":  # the guide: another tiny text model, saved
        from vembed.models import MODELS

        torch.manual_seed(3)
        MODELS.get("text").from_recipe(recipe_from_dict(scored_text_pairs)).save(tmp_path / "guide")
        raw["gist_guide"] = str(tmp_path / "guide")
    if case == "embedding_mse":  # a teacher of the student's size, its vectors of the rows extracted once
        from text_teachers import extract_teacher

        from vembed.models import MODELS

        torch.manual_seed(3)
        MODELS.get("text").from_recipe(recipe_from_dict(scored_text_pairs)).save(tmp_path / "teacher")
        raw["teacher_embeddings"] = str(tmp_path / "teacher_embeddings")
        extract_teacher(str(tmp_path / "teacher"), raw, tmp_path / "recipe.yaml")
    rows = list(range(BATCH))
    cached, cached_loss = _cached_step(raw, rows)
    reference, reference_loss = _reference_step(raw, rows, chunk=3)
    assert cached_loss == pytest.approx(reference_loss, rel=1e-6)
    assert reference_loss > 0
    _assert_close(cached, reference)


def test_without_dropout_cached_equals_the_plain_training_step(tiny_clip_recipe):
    raw = _no_dropout(dict(tiny_clip_recipe, batch_size=BATCH, use_gradient_cache=True, gradient_cache_chunk_size=3,
                           learnable_temperature=True))
    rows = list(range(BATCH))
    cached, _ = _cached_step(raw, rows)
    plain = _trainer(dict(raw, use_gradient_cache=False, gradient_cache_chunk_size=None))
    plain.train_step(_batch(plain, rows))
    _assert_close(cached, _grads(plain))


def test_replay_consumes_no_randomness(tiny_clip_recipe):
    """After a cached step the global RNG is where one no-grad pass left it, so later steps (and resume) match."""
    raw = dict(tiny_clip_recipe, batch_size=BATCH, use_gradient_cache=True, gradient_cache_chunk_size=4)
    trainer = _trainer(raw)
    batch = _batch(trainer, list(range(BATCH)))
    torch.manual_seed(3)
    trainer.train_step._encode_without_graph(batch)
    after_forward_only = torch.rand(1)
    torch.manual_seed(3)
    trainer.train_step(batch)
    assert torch.equal(torch.rand(1), after_forward_only)


def _ddp_worker(raw_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    raw = json.loads(Path(raw_path).read_text())
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    half = BATCH // world
    rows = list(range(rank * half, (rank + 1) * half))
    grads, _ = _cached_step(raw, rows)
    # Gradient sync happens once per step, not once per chunk: count DDP's bucket all-reduces.
    reductions = {}
    plain = {"use_gradient_cache": False, "gradient_cache_chunk_size": None}
    for name, overrides in (("cached", {}), ("plain", plain)):
        trainer = _trainer(dict(raw, **overrides))
        reductions[name] = _count_allreduces(trainer, _batch(trainer, rows))
    if rank == 0:
        torch.save(grads, Path(out_dir, "ddp.pt"))
        Path(out_dir, "reductions.json").write_text(json.dumps(reductions))


def _count_allreduces(trainer, batch) -> int:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    trainer.model.register_comm_hook(state=None, hook=counting_hook)
    trainer.train_step(batch)
    return len(calls)


def test_ddp_grad_cache_equals_one_process_on_the_concatenated_batch(tiny_clip_recipe, tmp_path):
    # 2 ranks x 4 samples, chunks of 3 (not dividing), two hard negatives, learnable temperature; dropout off because
    # two processes draw different masks than one.
    raw = _no_dropout(dict(tiny_clip_recipe, batch_size=BATCH // 2, use_gradient_cache=True,
                           gradient_cache_chunk_size=3, learnable_temperature=True))
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_ddp_worker, str(raw_path), str(tmp_path), world=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    reductions = json.loads((tmp_path / "reductions.json").read_text())
    assert reductions["cached"] == reductions["plain"] > 0, reductions  # 3 chunks per side, one sync
    single, _ = _reference_step(dict(raw, batch_size=BATCH), list(range(BATCH)), chunk=None)
    print(f"relative gradient difference: {_assert_close(ddp, single):.2e}")


def test_auto_rule_and_chunk_clamp():
    from vembed.planning import choose_gradient_cache

    base = {"model_type": "clip", "model_config": TINY_CLIP_CONFIG, "batch_size": 4}
    big = 2_000_000_000

    def choose(changes: dict, parameters: int, kind: str = "ddp"):
        return choose_gradient_cache(recipe_from_dict(dict(base, **changes)), kind, parameters)

    assert not choose({}, big).enabled
    auto = choose({"gradient_checkpointing": True}, big)
    assert auto.enabled and auto.chunk_size == 4 and "automatic" in auto.reason
    assert not choose({"gradient_checkpointing": True}, 10**8).enabled
    assert not choose({"gradient_checkpointing": True, "use_gradient_cache": False}, big).enabled
    on = choose({"batch_size": 64, "use_gradient_cache": True}, 10)
    assert on.enabled and on.chunk_size == 8
    # Where GradCache cannot run, the automatic rule leaves it off (the big-model FSDP recipe runs) and says why.
    for kind in ("fsdp", "deepspeed"):
        skipped = choose({"gradient_checkpointing": True}, big, kind)
        assert not skipped.enabled and "not available" in skipped.reason


def test_a_loss_that_cannot_run_under_grad_cache_is_refused_before_anything_is_built(monkeypatch):
    from vembed.errors import RecipeError
    from vembed.losses.scored import CoSENTLoss
    from vembed.planning import choose_gradient_cache

    monkeypatch.setattr(CoSENTLoss, "gradient_cache_refusal", "it needs the raw batch")
    recipe = {"model_type": "clip", "model_config": TINY_CLIP_CONFIG, "batch_size": 4, "loss_type": "cosent"}
    with pytest.raises(RecipeError, match="use_gradient_cache: loss_type cosent cannot run under GradCache: it needs"):
        choose_gradient_cache(recipe_from_dict(dict(recipe, use_gradient_cache=True)), "ddp", 10)
    automatic = choose_gradient_cache(recipe_from_dict(dict(recipe, gradient_checkpointing=True)), "ddp", 2 * 10**9)
    assert not automatic.enabled and "with loss_type cosent" in automatic.reason
    monkeypatch.undo()
    assert choose_gradient_cache(recipe_from_dict(dict(recipe, use_gradient_cache=True)), "ddp", 10).enabled


def test_cached_gradients_with_lora_and_gradient_checkpointing(tiny_clip_recipe):
    raw = _with_attention_dropout(dict(
        tiny_clip_recipe, batch_size=BATCH, use_gradient_cache=True, gradient_cache_chunk_size=3, use_lora=True,
        lora_r=4, lora_alpha=8, lora_dropout=0.1, gradient_checkpointing=True, mrl_dims=[16, 8],
    ))
    rows = list(range(BATCH))
    cached, _ = _cached_step(raw, rows)
    reference, _ = _reference_step(raw, rows, chunk=3)
    assert cached and all("lora_" in name or name.startswith("loss.") for name in cached)  # only adapters train
    _assert_close(cached, reference)
