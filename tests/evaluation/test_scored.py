"""Similarity evaluation (Spearman and Pearson of cosine vs gold scores, as sentence-transformers'
EmbeddingSimilarityEvaluator computes them with scipy) and triplet accuracy, alone and through `vembed eval`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vembed.evaluation.scored import pearson, similarity_metrics, spearman, triplet_accuracy

stats = pytest.importorskip("scipy.stats")


def test_correlations_equal_scipys_with_ties():
    generator = np.random.default_rng(0)
    x = generator.normal(size=50)
    y = np.round(x + generator.normal(size=50), 0)  # many ties, as gold scores on a 0-5 scale have
    x[:10] = x[0]
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)


def test_similarity_metrics_correlate_the_cosine_of_each_pair_with_its_gold_score():
    a, b = torch.randn(20, 8, generator=torch.Generator().manual_seed(1)), torch.randn(20, 8)
    gold = np.linspace(0, 5, 20)
    cosines = torch.nn.functional.cosine_similarity(a.double(), b.double()).numpy()
    metrics = similarity_metrics(a, b, gold)
    assert metrics["similarity/spearman_cosine"] == pytest.approx(stats.spearmanr(gold, cosines)[0], abs=1e-9)
    assert metrics["similarity/pearson_cosine"] == pytest.approx(stats.pearsonr(gold, cosines)[0], abs=1e-9)


def test_triplet_accuracy_is_the_share_with_the_positive_closer():
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.1], [0.0, 1.0], [0.0, 1.0]])
    n = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    assert triplet_accuracy(q, p, n)["triplet/cosine_accuracy"] == pytest.approx(2 / 3)


def test_vembed_eval_reports_similarity_and_triplet_metrics(tmp_path, tiny_tokenizer_dir):
    from vembed.components import recipe_from_dict
    from vembed.entrypoints.evaluate import main
    from vembed.models import MODELS
    from vembed.models.base import load_adapter

    recipe = recipe_from_dict({
        "model_type": "text", "pooling": "mean", "tokenizer_name": tiny_tokenizer_dir,
        "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32}})
    torch.manual_seed(0)
    MODELS.get("text").from_recipe(recipe).save(tmp_path / "model")
    rows = [{"query": f"a red circle number {i}", "positive": f"a {'red' if i % 2 else 'blue'} shape {i % 4}",
             "negatives": [f"green square {i}"], "score": (i * 3 % 7) / 7 * 5} for i in range(12)]
    data = tmp_path / "sts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main([str(tmp_path / "model"), str(data), "--output", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())

    adapter = load_adapter(tmp_path / "model")
    from vembed.data.records import Side
    from vembed.models.encoding import encode_sides

    q, p, n = (encode_sides(adapter, [Side(text=row[key] if key != "negatives" else row[key][0]) for row in rows])
               for key in ("query", "positive", "negatives"))
    cosines = torch.nn.functional.cosine_similarity(q.double(), p.double()).numpy()
    gold = [row["score"] for row in rows]
    assert metrics["similarity/spearman_cosine"] == pytest.approx(stats.spearmanr(gold, cosines)[0], abs=1e-5)
    assert metrics["similarity/pearson_cosine"] == pytest.approx(stats.pearsonr(gold, cosines)[0], abs=1e-5)
    assert metrics["triplet/cosine_accuracy"] == pytest.approx(triplet_accuracy(q, p, n)["triplet/cosine_accuracy"])
    assert "q2d/accuracy@1" in metrics  # retrieval as before


def test_in_run_evaluation_reports_them_per_named_source(tmp_path, tiny_tokenizer_dir):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    rows = [{"query": f"a red circle number {i}", "positive": f"a blue shape {i % 4}", "negatives": [f"square {i}"],
             "score": float(i % 5)} for i in range(10)]
    files = {}
    for name in ("sts", "nli"):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    trainer = Trainer(recipe_from_dict({
        "model_type": "text", "pooling": "mean", "tokenizer_name": tiny_tokenizer_dir, "loss_type": "cosent",
        "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32},
        "data": {"train": str(files["sts"]), "validation": {name: str(path) for name, path in files.items()}},
        "metric_for_best_model": "similarity/spearman_cosine", "output_dir": str(tmp_path / "run"),
        "batch_size": 4, "eval_before_training": False}))
    trainer.build()
    metrics = trainer.evaluate(trainer.eval_examples)
    for name in ("sts", "nli"):
        assert -1 <= metrics[f"{name}/similarity/spearman_cosine"] <= 1
        assert f"{name}/triplet/cosine_accuracy" in metrics
    assert metrics["similarity/spearman_cosine"] == pytest.approx(
        (metrics["sts/similarity/spearman_cosine"] + metrics["nli/similarity/spearman_cosine"]) / 2)
