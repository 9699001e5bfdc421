"""Exact corpus search: blocked top-k equals a full sort, and several ranks (each encoding its share) equal one."""

from __future__ import annotations

import torch
from ranks import run_on_ranks
from tiny_models import hashing_encoder

from vembed.retrieval.scoring import TopK, top_k
from vembed.retrieval.search import document_blocks, search


def _reference(queries: torch.Tensor, docs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full score matrix, sorted by (score descending, position ascending); cosines in float64 rounded to float32, so
    duplicate documents tie exactly here whatever kernel the machine picks."""
    unit = [torch.nn.functional.normalize(side.double(), dim=-1) for side in (queries, docs)]
    scores = (unit[0] @ unit[1].T).float()
    order = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, order), order


def test_blocked_top_k_equals_a_full_sort_with_ties_by_position():
    torch.manual_seed(0)
    queries, docs = torch.randn(37, 8), torch.randn(501, 8)
    docs[400] = docs[3]  # exact duplicates tie: the lower position must come first
    docs[250] = docs[3]
    expected_scores, expected_indices = _reference(queries, docs, 20)
    for chunk_elements in (64, 1000, 1 << 25):  # many small blocks, a few, one
        found = top_k(queries, docs, 20, chunk_elements=chunk_elements)
        assert torch.equal(found.indices, expected_indices)
        assert torch.allclose(found.scores, expected_scores, atol=1e-6)
    # Folding corpus blocks one by one (offsets) gives the same list.
    blocks = [(start, docs[start : start + 97]) for start in range(0, len(docs), 97)]
    folded = search(queries, blocks, 20)
    assert torch.equal(folded.indices, expected_indices)


def test_a_corpus_smaller_than_k_leaves_the_rest_empty():
    found = top_k(torch.randn(3, 4), torch.randn(2, 4), 5)
    assert (found.indices[:, 2:] == -1).all() and torch.isinf(found.scores[:, 2:]).all()
    assert sorted(found.indices[0, :2].tolist()) == [0, 1]
    merged = TopK.empty(3, 5).merge(found)
    assert torch.equal(merged.indices, found.indices)


def _corpus():
    from vembed.data.records import Side

    docs = [Side(text=f"document {i} about {'abcdefghij'[i % 10] * (i % 7 + 1)}") for i in range(203)]
    queries = [Side(text=f"query {i} {'abcdefghij'[i % 10]}") for i in range(11)]
    return queries, docs


def _search_on_ranks(out_file: str) -> None:
    from accelerate import Accelerator

    from vembed.models.encoding import encode_sides

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    queries, docs = _corpus()
    model = hashing_encoder()
    query_emb = encode_sides(model, queries, accelerator=accelerator, batch_size=4)
    blocks = list(document_blocks(model, docs, accelerator=accelerator, batch_size=4, documents_per_block=30))
    # Each rank scores only its own share of each block.
    assert sum(len(emb) for _, emb in blocks) < len(docs)
    found = search(query_emb, blocks, 15, accelerator=accelerator)
    if accelerator.is_main_process:
        torch.save({"scores": found.scores, "indices": found.indices}, out_file)


def test_two_ranks_each_encoding_a_share_find_what_one_process_finds(tmp_path):
    from vembed.models.encoding import encode_sides

    queries, docs = _corpus()
    model = hashing_encoder()
    expected_scores, expected_indices = _reference(encode_sides(model, queries), encode_sides(model, docs), 15)
    out = tmp_path / "found.pt"
    run_on_ranks(_search_on_ranks, str(out), world=2, timeout=120)
    found = torch.load(out, weights_only=True)
    assert torch.equal(found["indices"], expected_indices)
    assert torch.allclose(found["scores"], expected_scores, atol=1e-6)


def test_sparse_vectors_are_searched_and_paired_by_dot_product_whatever_the_caller_asks():
    from vembed.retrieval import SCORINGS

    generator = torch.Generator().manual_seed(3)
    queries = torch.relu(torch.randn(4, 50, generator=generator))
    documents = torch.relu(torch.randn(30, 50, generator=generator)) * torch.linspace(0.1, 3.0, 30).unsqueeze(1)
    scoring = SCORINGS.get("sparse")
    found = search(queries, [(0, documents[:17]), (17, documents[17:])], 5, score_block=scoring.top_k)
    dots = queries @ documents.T
    expected = dots.topk(5, dim=1)
    assert torch.equal(found.indices, expected.indices)
    torch.testing.assert_close(found.scores, expected.values)
    assert not torch.equal(found.indices, top_k(queries, documents, 5).indices)  # cosine would rank otherwise
    rows = torch.tensor([3, 0, 29, 7])
    torch.testing.assert_close(scoring.pair_scores(queries, documents, rows), dots[torch.arange(4), rows])
