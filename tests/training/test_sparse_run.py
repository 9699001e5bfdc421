"""A sparse (SPLADE) run end to end through `vembed train`'s entrypoint on a tiny BERT with its MLM head: InfoNCE with
FLOPS regularisation trains (the loss falls), its corpus validation split is searched by dot product, and final/
gives one set of vectors whichever way it is loaded: vembed, sentence-transformers' SparseEncoder, and the card's
plain-transformers snippet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from launching import train_in_this_process

import vembed
from vembed.model_card import EXAMPLE_TEXTS

DOCUMENTS = ["answer 3: a shape 3", "wrong answer 1", "question 2 about shape 2"]


@pytest.fixture
def sparse_run(tmp_path, tiny_tokenizer_dir):
    rows = [{"query": f"question {i} about shape {i % 5}", "positive": f"answer {i}: a shape {i % 5}",
             "negatives": [f"wrong answer {i}"]} for i in range(16)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "model_type": "text", "tokenizer_name": tiny_tokenizer_dir, "embedding": "sparse",
        "model_config": {"model_type": "bert", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32,
                         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        # sentence-transformers' SparseMultipleNegativesRankingLoss: dot products, scale 1, queries -> documents
        "loss_type": "infonce", "temperature": 1.0, "symmetric_loss": False,
        "flops_query_weight": 1e-3, "flops_document_weight": 1e-3,
        "data": {"train": str(path), "num_hard_negatives": 1}, "output_dir": str(tmp_path / "run"), "batch_size": 8,
        "max_steps": 4, "learning_rate": 2e-3, "logging_steps": 1, "seed": 0, "eval_before_training": False,
    }


def test_a_sparse_model_trains_through_vembed_train_and_its_final_folder_loads_everywhere_alike(sparse_run, tmp_path):
    from corpora import make_corpus_folder

    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import evaluate_corpus

    corpus = make_corpus_folder(tmp_path / "corpus")
    recipe = tmp_path / "sparse.yaml"
    recipe.write_text(yaml.safe_dump({**sparse_run, "data": {**sparse_run["data"], "validation": str(corpus)}}))
    train_in_this_process(recipe)
    run = Path(sparse_run["output_dir"])
    metrics = json.loads((run / "metrics.json").read_text())
    losses = [entry["loss"] for entry in metrics["loss_history"]]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
    # In-run evaluation searched the corpus as `vembed eval` does with final/: the same metrics.
    found = json.loads((run / "final" / "card.json").read_text())["evaluation"]["validation"]
    expected = evaluate_corpus(vembed.load(str(run / "final"), device="cpu").adapter, load_corpus_split(corpus, "dev"))
    for name in ("corpus/ndcg@10", "corpus/recall@10"):
        assert found[name] == pytest.approx(expected[name], abs=1e-6), name

    final = run / "final"
    model = vembed.load(str(final), device="cpu")
    vectors = model.encode(DOCUMENTS)
    assert vectors.shape == (3, 300) and (vectors >= 0).all() and (vectors == 0).any()
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SparseEncoder(str(final), device="cpu").encode(DOCUMENTS, convert_to_tensor=True).to_dense()
    torch.testing.assert_close(theirs, vectors, atol=1e-5, rtol=0)

    # The card says what it is, and its plain-transformers snippet computes the same vectors.
    card = (final / "README.md").read_text()
    assert "Sparse vectors (SPLADE" in card and "SparseEncoder(" in card and "vembed export" not in card
    snippet = card.split("With plain transformers:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(snippet.replace(repr(EXAMPLE_TEXTS), repr(DOCUMENTS)), namespace)
    torch.testing.assert_close(namespace["embeddings"], vectors, atol=1e-5, rtol=0)


def test_vembed_eval_reports_active_dimensions_and_the_inverted_index_size(sparse_run, tmp_path, capsys):
    """sentence-transformers' sparse IR evaluator reports query and corpus active dimensions; `vembed eval` on a
    sparse model reports them too (the mean non-zeros of the vectors it searched) and the corpus's CSR size."""
    from corpora import make_corpus_folder

    from vembed.data.corpus import load_corpus_split
    from vembed.entrypoints.evaluate import main as evaluate
    from vembed.evaluation.corpus import judged_queries
    from vembed.models.encoding import encode_sides

    corpus = make_corpus_folder(tmp_path / "corpus")
    recipe = tmp_path / "sparse.yaml"
    recipe.write_text(yaml.safe_dump(sparse_run))
    train_in_this_process(recipe)
    final = str(Path(sparse_run["output_dir"]) / "final")
    assert evaluate([final, str(corpus), "--split", "dev", "--output", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert "active dimensions per query" in capsys.readouterr().err

    adapter = vembed.load(final, device="cpu").adapter
    split = load_corpus_split(corpus, "dev")
    queries = encode_sides(adapter, [split.queries.sides[split.queries.index[q]] for q in judged_queries(split, None)])
    documents = encode_sides(adapter, split.corpus.sides)
    nonzeros = int((documents != 0).sum())
    assert metrics["sparse/query_active_dims"] == pytest.approx(float((queries != 0).sum(1).float().mean()))
    assert metrics["sparse/corpus_active_dims"] == pytest.approx(nonzeros / len(documents))
    # The index's real CSR (one block of 36 documents): float32 weights, int32 term ids and int32 row offsets.
    assert metrics["index/bytes_csr"] == nonzeros * 8 + (len(documents) + 1) * 4
    assert 0 < metrics["sparse/corpus_active_dims"] < 300  # sparse: fewer than the vocabulary's 300


# --- inference-free SPLADE (query_encoder: static) and the FLOPS warmup ----------------------------------------------

@pytest.fixture
def static_run(sparse_run):
    # sentence-transformers' inference-free recipe: no FLOPS on the static queries (query weight 0), the documents'
    # weight warmed up.
    return {**sparse_run, "query_encoder": "static", "flops_query_weight": 0.0, "flops_warmup_ratio": 0.5}


def _built(raw: dict):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    return trainer


def test_the_static_weights_start_at_the_idf_of_the_runs_documents_and_train_at_their_own_rate(static_run,
                                                                                               tiny_tokenizer_dir):
    import math

    from transformers import AutoTokenizer

    trainer = _built({**static_run, "static_query_lr": 0.05})
    weight = trainer.adapter.static_query_weight
    # By hand: the distinct positives and hard negatives of the 16 rows, each a set of tokens (no special tokens), cut
    # at max_length (unset: the tokenizer's 16) as queries are.
    rows = [json.loads(line) for line in Path(static_run["data"]["train"]).read_text().splitlines()]
    documents = {text for row in rows for text in (row["positive"], *row["negatives"])}
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    df = [0] * 300
    for text in documents:
        for token in set(tokenizer(text, add_special_tokens=False, truncation=True, max_length=16)["input_ids"]):
            df[token] += 1
    n = len(documents)
    assert n == 32 and max(df) == n  # every document shares a token
    expected = torch.tensor([math.log(1 + (n - d + 0.5) / (d + 0.5)) for d in df])
    torch.testing.assert_close(weight.detach(), expected, atol=1e-6, rtol=0)
    own = [group for group in trainer.optimizer.param_groups if any(p is weight for p in group["params"])]
    assert len(own) == 1 and own[0]["params"] == [weight] and own[0]["initial_lr"] == pytest.approx(0.05)
    others = [group["initial_lr"] for group in trainer.optimizer.param_groups if group is not own[0]]
    assert others and all(lr == pytest.approx(static_run["learning_rate"]) for lr in others)
    assert trainer.optimizer.param_groups[0] is not own[0]  # the logged rate stays the run's


def test_the_loop_tells_the_loss_the_step_so_a_resumed_run_has_the_warmed_up_weight(static_run):
    from accelerate.utils import send_to_device

    from vembed.losses.sparse import warmup_factor
    from vembed.training.checkpoint import TrainerState

    trainer = _built(static_run)  # 4 steps, warmup 0.5: 2 steps, quadratic
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(8)]),
                           trainer.accelerator.device)
    loss = trainer.objective.loss
    for step, factor in ((0, 0.0), (1, 0.25), (3, 1.0)):  # step 3: as a run resumed after 3 steps
        trainer.train_on_batch(batch, TrainerState(global_step=step))
        assert loss.weight_factor == factor == warmup_factor(step, 4, 0.5, "quadratic")


def test_an_inference_free_model_trains_and_its_final_folder_gives_the_same_vectors_in_sentence_transformers(
        static_run, tmp_path):
    recipe = tmp_path / "static.yaml"
    recipe.write_text(yaml.safe_dump(static_run))
    train_in_this_process(recipe)
    run = Path(static_run["output_dir"])
    losses = [entry["loss"] for entry in json.loads((run / "metrics.json").read_text())["loss_history"]]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
    model = vembed.load(str(run / "final"), device="cpu")
    queries, documents = model.encode(DOCUMENTS, role="query"), model.encode(DOCUMENTS, role="document")
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SparseEncoder(str(run / "final"), device="cpu")
    torch.testing.assert_close(theirs.encode_query(DOCUMENTS, convert_to_tensor=True).to_dense(), queries,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs.encode_document(DOCUMENTS, convert_to_tensor=True).to_dense(), documents,
                               atol=1e-5, rtol=0)
    assert not torch.equal(queries, documents)
    # The card encodes queries and documents apart, by role (its snippets run as written on final/).
    card = (run / "final" / "README.md").read_text()
    assert "encode_query(" in card and "encode_document(" in card and "role='query'" in card
    vembed_snippet = card.split("With vembed", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(vembed_snippet, namespace)
    torch.testing.assert_close(namespace["queries"], model.encode(EXAMPLE_TEXTS[:1], role="query"), atol=1e-6, rtol=0)


def test_gradient_cache_and_length_chunks_give_a_static_query_encoder_the_whole_batch_step(static_run):
    from one_step import one_step, relative_difference

    raw = {**static_run, "flops_warmup_ratio": None, "flops_query_weight": 1e-2}
    plain, plain_loss, _ = one_step(raw, list(range(8)))
    chunked, loss, _ = one_step({**raw, "use_gradient_cache": True, "gradient_cache_chunk_size": 3,
                                 "length_chunks": 2}, list(range(8)))
    assert plain["adapter.static_query_weight"].abs().sum() > 0
    assert abs(loss - plain_loss) <= 1e-5 * abs(plain_loss) and relative_difference(chunked, plain) <= 1e-5


@pytest.mark.slow
def test_two_ranks_train_a_static_query_encoder_as_one_process_on_the_whole_batch(static_run, tmp_path):
    from one_step import one_step, relative_difference, two_rank_gradients

    raw = {**static_run, "flops_warmup_ratio": None, "flops_query_weight": 1e-2}  # every term, from step 1
    ddp = two_rank_gradients({**raw, "batch_size": 4}, tmp_path, 8)
    one, _, _ = one_step({**raw, "batch_size": 8}, list(range(8)))
    assert "adapter.static_query_weight" in one and one["adapter.static_query_weight"].abs().sum() > 0
    assert relative_difference(ddp, one) <= 1e-5
