"""Pair evaluation (vembed/evaluation/pairs.py): retrieval metrics against hand-computed values, and
evaluate_retrieval on a lookup-table adapter."""

from __future__ import annotations

import math

import pytest
import torch

from vembed.data.records import Example, Side
from vembed.errors import DataError
from vembed.evaluation.pairs import (
    GroupRelevance,
    encode_sides,
    evaluate_retrieval,
    renamed_metric,
    retrieval_metrics,
    zero_shot_accuracy,
)
from vembed.models.base import AdapterSettings, EmbeddingAdapter


class LookupAdapter(EmbeddingAdapter):
    """Embeds a side by looking its text up in a table: embeddings chosen by the test, no model involved."""

    model_type = "test_lookup"

    def __init__(self, table: dict[str, list[float]]):
        super().__init__(AdapterSettings())
        self.names = list(table)
        self.table = torch.nn.Parameter(torch.tensor([table[n] for n in self.names], dtype=torch.float32))

    @classmethod
    def embedding_dim_for(cls, recipe):
        raise NotImplementedError

    @classmethod
    def from_recipe(cls, recipe):
        raise NotImplementedError

    @property
    def embedding_dim(self) -> int:
        return self.table.shape[1]

    def preprocess(self, sides):
        return {"index": torch.tensor([self.names.index(s.text or s.image) for s in sides])}

    def encode(self, inputs):
        return torch.nn.functional.normalize(self.table[inputs["index"]], dim=-1)

    def towers(self):
        return []  # a lookup table: nothing to checkpoint or wrap with LoRA

    def save(self, path):
        raise NotImplementedError

    @classmethod
    def load(cls, path):
        raise NotImplementedError


def _ex(query: str, positive: str, label: str | None = None) -> Example:
    return Example(query=Side(text=query), positive=Side(text=positive), label=label)


def _reference(query_emb, doc_emb, relevance, ks=(1, 5, 10)):
    """The definitions, one query at a time: a full sort, equal scores by document position (lowest first)."""
    q = torch.nn.functional.normalize(query_emb.double(), dim=-1)
    d = torch.nn.functional.normalize(doc_emb.double(), dim=-1)
    scores = (q @ d.T).tolist()
    firsts, ndcgs = [], []
    for row, rel in zip(scores, relevance.tolist()):
        if not any(rel):
            continue
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))
        ranks = [r + 1 for r, j in enumerate(order) if rel[j]]
        firsts.append(ranks[0])
        dcg = sum(1 / math.log2(r + 1) for r in ranks if r <= 10)
        ideal = sum(1 / math.log2(r + 1) for r in range(1, min(len(ranks), 10) + 1))
        ndcgs.append(dcg / ideal)
    out = {f"accuracy@{k}": sum(r <= k for r in firsts) / len(firsts) for k in ks}
    out["mrr"] = sum(1 / r for r in firsts) / len(firsts)
    out["ndcg@10"] = sum(ndcgs) / len(ndcgs)
    return out


# --- retrieval_metrics ---------------------------------------------------------------------------------------------

DOCS = torch.eye(4)  # document j has cosine q[j] / |q| with query q, so each query's ranking is read off its entries


def test_single_relevant_document_accuracy_mrr_ndcg_match_hand_values():
    queries = torch.tensor([[4.0, 3, 2, 1], [4.0, 3, 2, 1], [1.0, 2, 3, 4]])  # rankings 0123, 0123, 3210
    relevance = torch.tensor([[1, 0, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)  # at ranks 1, 3, 4
    metrics = retrieval_metrics(queries, DOCS, relevance, ks=(1, 3))
    assert metrics["accuracy@1"] == pytest.approx(1 / 3)
    assert metrics["accuracy@3"] == pytest.approx(2 / 3)
    assert metrics["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 4) / 3)
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4) + 1 / math.log2(5)) / 3)
    assert set(metrics) == {"accuracy@1", "accuracy@3", "mrr", "ndcg@10"}


def test_several_relevant_documents_use_the_first_for_accuracy_and_mrr_and_all_for_ndcg():
    queries = torch.tensor([[4.0, 3, 2, 1]])
    relevance = torch.tensor([[0, 1, 0, 1]], dtype=torch.bool)  # relevant at ranks 2 and 4
    metrics = retrieval_metrics(queries, DOCS, relevance, ks=(1, 2))
    assert metrics["accuracy@1"] == 0.0
    assert metrics["accuracy@2"] == 1.0
    assert metrics["mrr"] == pytest.approx(1 / 2)
    ideal = 1 + 1 / math.log2(3)
    assert metrics["ndcg@10"] == pytest.approx((1 / math.log2(3) + 1 / math.log2(5)) / ideal)


def test_ndcg_ignores_relevant_documents_below_rank_10_and_caps_the_ideal_at_10():
    n_docs = 30
    docs = torch.eye(n_docs)
    query = torch.arange(n_docs, 0, -1, dtype=torch.float32)[None]  # ranks documents 0, 1, 2, ... in order
    relevance = torch.zeros(1, n_docs, dtype=torch.bool)
    relevance[0, [0, 9, 10, 20]] = True  # ranks 1, 10, 11, 21
    metrics = retrieval_metrics(query, docs, relevance)
    ideal = sum(1 / math.log2(r + 1) for r in range(1, 5))
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(11)) / ideal)
    relevance[0, :12] = True  # 12 relevant documents: the ideal DCG counts 10 of them; the top 10 are all relevant
    assert retrieval_metrics(query, docs, relevance)["ndcg@10"] == pytest.approx(1.0)


def test_ties_rank_by_document_position_so_collapsed_embeddings_score_as_corpus_order():
    queries, docs = torch.ones(3, 8), torch.ones(5, 8)
    relevance = torch.eye(3, 5, dtype=torch.bool)  # query i's document at position i: rank i + 1
    metrics = retrieval_metrics(queries, docs, relevance)
    assert metrics["accuracy@1"] == pytest.approx(1 / 3)
    assert metrics["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3) + 1 / 2) / 3)
    reversed_relevance = relevance.flip(1)  # query i's document at position 4 - i: rank 5 - i
    assert retrieval_metrics(queries, docs, reversed_relevance)["mrr"] == pytest.approx((1 / 5 + 1 / 4 + 1 / 3) / 3)


def test_nan_embeddings_rank_last():
    queries = torch.tensor([[4.0, 3, 2, 1], [1.0, 2, 3, 4]])
    docs = DOCS.clone()
    docs[0] = float("nan")  # query 0's document: last (rank 4); query 1's: third after documents 3 and 2
    metrics = retrieval_metrics(queries, docs, torch.eye(2, 4, dtype=torch.bool))
    assert metrics["accuracy@1"] == 0.0 and metrics["mrr"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    nan_queries = torch.full((2, 4), float("nan"))  # every score NaN: corpus order
    assert retrieval_metrics(nan_queries, DOCS, torch.eye(2, 4, dtype=torch.bool))["mrr"] == pytest.approx(3 / 4)


def test_queries_without_relevant_documents_are_left_out_of_the_average():
    queries = torch.tensor([[4.0, 3, 2, 1], [1.0, 2, 3, 4]])
    relevance = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert retrieval_metrics(queries, DOCS, relevance)["mrr"] == 1.0
    with pytest.raises(ValueError, match="no query has a relevant document"):
        retrieval_metrics(queries, DOCS, torch.zeros(2, 4, dtype=torch.bool))


def test_relevance_shape_is_checked():
    with pytest.raises(ValueError, match="expected"):
        retrieval_metrics(torch.ones(2, 4), DOCS, torch.ones(4, 2, dtype=torch.bool))


def test_chunked_group_relevance_matches_the_reference_on_random_data():
    gen = torch.Generator().manual_seed(0)
    queries, docs = torch.randn(37, 6, generator=gen), torch.randn(53, 6, generator=gen)
    query_groups, doc_groups = torch.randint(0, 7, (37,), generator=gen), torch.randint(0, 7, (53,), generator=gen)
    dense = query_groups[:, None] == doc_groups[None, :]
    expected = _reference(queries, docs, dense, ks=(1, 3, 5, 10))
    for relevance in (dense, dense.tolist(), GroupRelevance(query_groups, doc_groups)):
        for chunk_size in (None, 1, 8):
            got = retrieval_metrics(queries, docs, relevance, ks=(1, 3, 5, 10), chunk_size=chunk_size)
            assert got == pytest.approx(expected)


def test_fewer_documents_than_ndcg_cutoff():
    gen = torch.Generator().manual_seed(1)
    queries, docs = torch.randn(9, 3, generator=gen), torch.randn(4, 3, generator=gen)
    relevance = torch.rand(9, 4, generator=gen) > 0.5
    relevance[:, 0] = True
    assert retrieval_metrics(queries, docs, relevance) == pytest.approx(_reference(queries, docs, relevance))


# --- evaluate_retrieval --------------------------------------------------------------------------------------------

TABLE = {"A": [1.0, 0.0], "B": [0.0, 1.0], "C": [0.8, 0.6], "a": [1.0, 0.1], "b": [1.0, 0.5], "c": [0.2, 1.0]}


def test_evaluate_retrieval_dedupes_positives_and_scores_both_directions():
    adapter = LookupAdapter(TABLE)
    # Queries a, b, c; positives A, B, A -> corpus {A, B}. Query rankings: a: A B, b: A B, c: B A.
    # Document rankings over queries: A: a b c (relevant a, c), B: c b a (relevant b).
    metrics = evaluate_retrieval(adapter, [_ex("a", "A"), _ex("b", "B"), _ex("c", "A")])
    assert metrics["num_queries"] == 3 and metrics["num_documents"] == 2
    assert metrics["q2d/accuracy@1"] == pytest.approx(1 / 3)
    assert metrics["q2d/accuracy@5"] == 1.0
    assert metrics["q2d/mrr"] == pytest.approx((1 + 1 / 2 + 1 / 2) / 3)
    assert metrics["q2d/ndcg@10"] == pytest.approx((1 + 2 / math.log2(3)) / 3)
    assert metrics["d2q/accuracy@1"] == pytest.approx(1 / 2)
    assert metrics["d2q/mrr"] == pytest.approx((1 + 1 / 2) / 2)
    ndcg_a = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    assert metrics["d2q/ndcg@10"] == pytest.approx((ndcg_a + 1 / math.log2(3)) / 2)
    expected_keys = {f"{d}/{m}" for d in ("q2d", "d2q") for m in ("accuracy@1", "accuracy@5", "accuracy@10", "mrr",
                                                                  "ndcg@10")}
    assert set(metrics) == expected_keys | {"num_queries", "num_documents"}


def test_labels_make_every_document_of_the_label_relevant():
    adapter = LookupAdapter(TABLE)
    # Label x: queries a, b, a (again) with positives A, B, A -> documents A, B; label y: query c with document C.
    # Query rankings: a: A C B (first relevant at 1), b: C A B (2), c: B C A (2).
    examples = [_ex("a", "A", "x"), _ex("b", "B", "x"), _ex("c", "C", "y"), _ex("a", "A", "x")]
    metrics = evaluate_retrieval(adapter, examples)
    assert metrics["num_queries"] == 4 and metrics["num_documents"] == 3
    assert metrics["q2d/accuracy@1"] == pytest.approx(2 / 4)
    assert metrics["q2d/mrr"] == pytest.approx((1 + 1 / 2 + 1 / 2 + 1) / 4)
    ideal_two = 1 + 1 / math.log2(3)
    ndcg = [(1 + 1 / math.log2(4)) / ideal_two, (1 / math.log2(3) + 1 / math.log2(4)) / ideal_two, 1 / math.log2(3)]
    assert metrics["q2d/ndcg@10"] == pytest.approx((2 * ndcg[0] + ndcg[1] + ndcg[2]) / 4)
    # Document rankings over queries a, b, c, a: A: a a b c (1), B: c b a a (2), C: b a a c (4: the copies of a tie).
    assert metrics["d2q/accuracy@1"] == pytest.approx(1 / 3)
    assert metrics["d2q/mrr"] == pytest.approx((1 + 1 / 2 + 1 / 4) / 3)


def test_the_same_positive_under_two_labels_is_two_documents():
    examples = [_ex("a", "A", "x"), _ex("b", "A", "y")]
    assert evaluate_retrieval(LookupAdapter(TABLE), examples)["num_documents"] == 2


def test_labels_on_some_records_only_is_a_data_error():
    with pytest.raises(DataError, match="1 of 2 evaluation records have a label"):
        evaluate_retrieval(LookupAdapter(TABLE), [_ex("a", "A", "x"), _ex("b", "B")])


def test_mrl_dims_add_truncated_renormalised_metrics():
    gen = torch.Generator().manual_seed(0)
    names = [f"q{i}" for i in range(6)] + [f"d{i}" for i in range(6)]
    table = {name: torch.randn(8, generator=gen).tolist() for name in names}
    adapter = LookupAdapter(table)
    examples = [_ex(f"q{i}", f"d{i}") for i in range(6)]
    metrics = evaluate_retrieval(adapter, examples, mrl_dims=[2, 4], batch_size=4)
    for d in (2, 4):
        assert {k for k in metrics if f"/dim{d}/" in k} == {
            f"{direction}/dim{d}/{m}" for direction in ("q2d", "d2q")
            for m in ("accuracy@1", "accuracy@5", "accuracy@10", "mrr", "ndcg@10")
        }
    queries = torch.tensor([table[f"q{i}"] for i in range(6)])[:, :2]
    docs = torch.tensor([table[f"d{i}"] for i in range(6)])[:, :2]
    expected = _reference(queries, docs, torch.eye(6, dtype=torch.bool))
    assert {k: metrics[f"q2d/dim2/{k}"] for k in expected} == pytest.approx(expected)
    with pytest.raises(ValueError, match="mrl_dims"):
        evaluate_retrieval(adapter, examples, mrl_dims=[16])


def test_encoding_runs_in_eval_mode_without_grad_and_restores_train_mode():
    seen = []

    class Spy(LookupAdapter):
        def encode(self, inputs):
            seen.append((self.training, torch.is_grad_enabled()))
            return super().encode(inputs)

    adapter = Spy(TABLE).train()
    out = encode_sides(adapter, [Side(text=t) for t in "abcAB"], batch_size=2)
    assert out.shape == (5, 2) and out.dtype == torch.float32
    assert seen == [(False, False)] * 3
    assert adapter.training


@pytest.fixture
def fresh_accelerate_state():
    """Accelerator() fills accelerate's process-wide state; leave none behind for later tests (or forked workers)."""
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_single_process_accelerator_gives_the_same_metrics(fresh_accelerate_state):
    from accelerate import Accelerator

    examples = [_ex("a", "A"), _ex("b", "B"), _ex("c", "A")]
    adapter = LookupAdapter(TABLE)
    with_accelerator = evaluate_retrieval(adapter, examples, accelerator=Accelerator(cpu=True))
    assert with_accelerator == evaluate_retrieval(adapter, examples)


def test_zero_shot_accuracy_picks_the_nearest_class_prompt():
    adapter = LookupAdapter(TABLE)
    # Positives a, b are nearest to prompt "A", c to prompt "B".
    examples = [_ex("q", "a", "0"), _ex("q", "b", "1"), _ex("q", "c", "1")]
    assert zero_shot_accuracy(adapter, examples, {0: "A", 1: "B"}) == pytest.approx(2 / 3)
    with pytest.raises(DataError, match="no class prompt"):
        zero_shot_accuracy(adapter, examples, {0: "A"})


def _evaluate_in_process(rank: int, world: int, port: int, table, examples, out_dir) -> None:
    import os

    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    os.environ.update({key: str(value) for key, value in env.items()})
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world
    metrics = evaluate_retrieval(LookupAdapter(table), examples, accelerator=accelerator, batch_size=2, mrl_dims=[2])
    torch.save(metrics, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_shard_the_encoding_and_agree_with_one(tmp_path):
    import socket
    import time

    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(0)
    names = [f"q{i}" for i in range(7)] + [f"d{i}" for i in range(7)]
    table = {name: torch.randn(4, generator=gen).tolist() for name in names}
    examples = [_ex(f"q{i}", f"d{i}") for i in range(7)]  # 7 sides over 2 processes: shares of 4 and 3 (+1 padding)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # spawn, not fork: a forked child inherits torch's thread pool and accelerate's singletons, and can hang.
    context = mp.spawn(_evaluate_in_process, args=(2, port, table, examples, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two evaluation processes did not finish within 120 s")
    expected = evaluate_retrieval(LookupAdapter(table), examples, mrl_dims=[2])
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == pytest.approx(expected)


def test_real_clip_on_captions_and_image_files_matches_scoring_by_hand(tiny_clip_recipe, dummy_data_dir):
    """A tiny CLIP on the dummy shapes: captions retrieve image files, relevance by label (shape-colour)."""
    import json

    from vembed.components import recipe_from_dict
    from vembed.data.sources import load_examples
    from vembed.models import MODELS

    recipe = recipe_from_dict(tiny_clip_recipe)
    torch.manual_seed(0)
    adapter = MODELS.get("clip").from_recipe(recipe).train()
    examples, _ = load_examples(recipe.data, "validation", num_hard_negatives=0)
    metrics = evaluate_retrieval(adapter, examples, batch_size=5, mrl_dims=[8])
    assert adapter.training

    adapter.eval()
    by_doc = {(ex.positive.image, ex.label): ex.positive for ex in examples}
    doc_labels = [label for _, label in by_doc]
    with torch.no_grad():
        queries = adapter.encode(adapter.preprocess([ex.query for ex in examples]))
        docs = adapter.encode(adapter.preprocess(list(by_doc.values())))
    relevance = torch.tensor([[ex.label == label for label in doc_labels] for ex in examples])
    assert metrics["num_documents"] == len(by_doc) and metrics["num_queries"] == len(examples)
    for prefix, q, d in (("", queries, docs), ("dim8/", queries[:, :8], docs[:, :8])):
        expected = retrieval_metrics(q, d, relevance)
        assert {k: metrics[f"q2d/{prefix}{k}"] for k in expected} == pytest.approx(expected, abs=1e-6)
        assert metrics[f"d2q/{prefix}mrr"] == pytest.approx(retrieval_metrics(d, q, relevance.T)["mrr"], abs=1e-6)

    prompts = json.loads((dummy_data_dir / "classes.json").read_text())
    names = list(prompts)
    with torch.no_grad():
        prompt_emb = adapter.encode(adapter.preprocess([Side(text=prompts[n]) for n in names]))
        images = adapter.encode(adapter.preprocess([ex.positive for ex in examples]))
    predicted = [names[int(i)] for i in (images @ prompt_emb.T).argmax(dim=1)]
    expected = sum(p == ex.label for p, ex in zip(predicted, examples)) / len(examples)
    assert zero_shot_accuracy(adapter, examples, prompts) == pytest.approx(expected)


def test_old_hit_rate_names_map_to_accuracy_and_nothing_else_is_renamed():
    assert renamed_metric("q2d/recall@1") == "q2d/accuracy@1"
    assert renamed_metric("d2q/dim64/recall@10") == "d2q/dim64/accuracy@10"
    assert renamed_metric("digits/q2d/dim8/recall@5") == "digits/q2d/dim8/accuracy@5"
    for current in ("q2d/accuracy@1", "corpus/recall@10", "beir/corpus/recall@1", "reranked/recall@10", "q2d/mrr",
                    "a/b/q2d/recall@1", "q2d/recall@k"):
        assert renamed_metric(current) is None, current
