"""Corpus metrics against trec_eval (pytrec_eval): nDCG@k, recall@k, MAP@k, MRR@k per query and averaged."""

from __future__ import annotations

import random

import pytest
import torch

from vembed.evaluation.corpus import (
    Cutoffs,
    corpus_metrics,
    per_query_metrics,
    rankings_from_run,
    rankings_from_topk,
)
from vembed.retrieval.scoring import TopK

pytrec_eval = pytest.importorskip("pytrec_eval")

CUTOFFS = Cutoffs(ndcg=(1, 3, 10), recall=(1, 10, 100), map=(5, 100), mrr=(1000,))  # mrr@1000: no cut (below)
TREC = {"ndcg_cut.1,3,10", "recall.1,10,100", "map_cut.5,100", "recip_rank"}


def _trec_name(name: str) -> str:
    metric, k = name.split("@")
    return {"ndcg": f"ndcg_cut_{k}", "recall": f"recall_{k}", "map": f"map_cut_{k}", "mrr": "recip_rank"}[metric]


def _random_case(seed: int, *, ties: bool) -> tuple[dict, dict]:
    """Graded qrels (0-3, some queries with only grade 0) and a run retrieving 0..150 documents of 300."""
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(300)]
    qrels, run = {}, {}
    for q in range(60):
        judged = rng.sample(docs, rng.randint(1, 25))
        qrels[f"q{q}"] = {d: rng.choice([0, 0, 1, 2, 3]) for d in judged}
        if q % 9 == 0:
            qrels[f"q{q}"] = {d: 0 for d in judged}  # judged, nothing relevant
        retrieved = rng.sample(docs, rng.randint(0, 150))  # some fewer than k (even none)
        if q % 4 == 0:  # retrieve some relevant documents, so that scores are not all near zero
            retrieved = list(dict.fromkeys(judged[:5] + retrieved))
        boost = 0.5 if q % 2 == 0 else 0.0  # half the queries rank judged documents higher
        scores = [rng.random() + (boost if d in qrels[f"q{q}"] else 0.0) for d in retrieved]
        scores = [round(s, 1) if ties else s for s in scores]
        run[f"q{q}"] = dict(zip(retrieved, scores))
    run["unjudged"] = {"d1": 1.0}
    return qrels, run


def _reference(qrels: dict, run: dict) -> dict[str, dict[str, float]]:
    """pytrec_eval's per-query values of the queries that have a relevant document (its run: no empty lists)."""
    found = pytrec_eval.RelevanceEvaluator(qrels, TREC).evaluate({q: d for q, d in run.items() if d})
    ours = [q for q, judged in qrels.items() if any(g > 0 for g in judged.values())]
    zeros = {m: 0.0 for m in found[next(iter(found))]}
    return {q: found.get(q, zeros) for q in ours}  # a query without results scores 0 (trec_eval -c)


@pytest.mark.parametrize("ties", [False, True])
def test_per_query_and_mean_metrics_equal_trec_eval(ties):
    qrels, run = _random_case(ties, ties=ties)
    reference = _reference(qrels, run)
    ours = per_query_metrics(rankings_from_run(run), qrels, CUTOFFS)
    assert set(ours) == set(reference) and len(ours) < len(qrels)  # all-zero queries are left out
    for query, values in ours.items():
        for name, value in values.items():
            assert value == pytest.approx(reference[query][_trec_name(name)], abs=1e-6), (query, name)
    means = corpus_metrics(run, qrels, CUTOFFS)
    for name in CUTOFFS.names():
        expected = sum(r[_trec_name(name)] for r in reference.values()) / len(reference)
        assert means[name] == pytest.approx(expected, abs=1e-6), name
    assert means["num_queries"] == len(reference)
    assert means["num_queries_without_relevant"] == len(qrels) - len(reference)
    assert 0.05 < means["ndcg@10"] < 0.95  # the case exercises the metric, not only its zeros


def test_mrr_at_k_is_trec_recip_rank_of_the_run_cut_to_k():
    qrels, run = _random_case(3, ties=False)
    cut = {q: dict(sorted(d.items(), key=lambda item: -item[1])[:10]) for q, d in run.items()}
    reference = _reference(qrels, cut)
    ours = per_query_metrics(rankings_from_run(run), qrels, Cutoffs(ndcg=(), recall=(), map=(), mrr=(10,)))
    assert any(0 < values["mrr@10"] < 1 for values in ours.values())
    for query, values in ours.items():
        assert values["mrr@10"] == pytest.approx(reference[query]["recip_rank"], abs=1e-6)


def test_a_topk_of_corpus_positions_scores_as_the_same_run():
    qrels = {"q1": {"a": 2, "c": 1}, "q2": {"b": 1}}
    doc_ids = ["a", "b", "c", "d"]
    top = TopK(torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.7, -torch.inf]]), torch.tensor([[3, 2, 0], [0, 1, -1]]))
    assert rankings_from_topk(top, ["q1", "q2"], doc_ids) == {"q1": ["d", "c", "a"], "q2": ["a", "b"]}
    run = {"q1": {"d": 0.9, "c": 0.5, "a": 0.1}, "q2": {"a": 0.8, "b": 0.7}}
    assert corpus_metrics(top, qrels, query_ids=["q1", "q2"], doc_ids=doc_ids) == corpus_metrics(run, qrels)
    found = corpus_metrics(run, qrels)
    assert found["mrr@10"] == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert found["recall@1"] == 0.0 and found["recall@10"] == 1.0


# --- evaluation of an adapter on a corpus folder -------------------------------------------------------------------


def _text_adapter(tokenizer_dir: str):
    from corpora import text_model_keys

    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    torch.manual_seed(0)
    return MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tokenizer_dir))).eval()


def _evaluate_on_ranks(folder: str, tokenizer_dir: str, out_file: str) -> None:
    import json

    from accelerate import Accelerator

    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import evaluate_corpus

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    found = evaluate_corpus(_text_adapter(tokenizer_dir), load_corpus_split(folder, "train"), batch_size=4,
                            accelerator=accelerator, documents_per_block=5)  # 4 blocks of 10, each rank 5
    if accelerator.is_main_process:
        with open(out_file, "w") as handle:
            json.dump(found, handle)


def test_two_ranks_evaluate_a_corpus_as_one_process(tmp_path, tiny_tokenizer_dir):
    import json

    from corpora import make_corpus_folder
    from ranks import run_on_ranks

    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import evaluate_corpus

    folder = make_corpus_folder(tmp_path / "corpus")
    split = load_corpus_split(folder, "train")
    expected = evaluate_corpus(_text_adapter(tiny_tokenizer_dir), split, batch_size=7)
    assert set(expected) == {"corpus/ndcg@10", "corpus/recall@1", "corpus/recall@10", "corpus/recall@100",
                             "corpus/map@100", "corpus/mrr@10", "num_queries", "num_documents"}
    assert expected["num_documents"] == 36 and expected["num_queries"] == 10
    assert expected["corpus/recall@100"] == 1.0  # 36 documents: all retrieved
    assert 0 < expected["corpus/ndcg@10"] < 1
    out = tmp_path / "found.json"
    run_on_ranks(_evaluate_on_ranks, str(folder), tiny_tokenizer_dir, str(out), world=2, timeout=120)
    found = json.loads(out.read_text())
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, abs=1e-6), key
