"""A saved multi_vector (ColBERT) model through the commands: `vembed eval` on a corpus folder and `vembed mine` search
its token vectors by MaxSim; a command that scores one vector per side refuses it in one line, exit 2, nothing
written."""

from __future__ import annotations

import json

import pytest
from corpora import make_corpus_folder, write_pairs

from vembed.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory, mask_tokenizer_dir):
    """A tiny random-init ColBERT saved by vembed, the 36-document corpus folder of tests/corpora.py, and pairs."""
    import torch

    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    root = tmp_path_factory.mktemp("colbert")
    config = {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32}
    recipe = recipe_from_dict({"model_type": "text", "tokenizer_name": mask_tokenizer_dir, "model_config": config,
                               "embedding": "multi_vector", "multi_vector_dim": 16, "query_length": 12,
                               "max_length": 30, "loss_type": "late_interaction"})
    torch.manual_seed(0)
    MODELS.get("text").from_recipe(recipe).save(root / "model")
    corpus = make_corpus_folder(root / "corpus")
    write_pairs(corpus, root / "pairs.jsonl")
    return root


def test_eval_searches_a_corpus_by_maxsim_and_a_pool_factor_changes_the_index(saved, tmp_path, capsys):
    full, pooled = tmp_path / "full.json", tmp_path / "pooled.json"
    assert main(["eval", str(saved / "model"), str(saved / "corpus"), "--split", "train", "--output", str(full)]) == 0
    assert main(["eval", str(saved / "model"), str(saved / "corpus"), "--split", "train", "--pool-factor", "3",
                 "--output", str(pooled)]) == 0
    full, pooled = json.loads(full.read_text()), json.loads(pooled.read_text())
    assert full["num_documents"] == pooled["num_documents"] == 36
    assert 0 < full["corpus/ndcg@10"] <= 1 and 0 < pooled["corpus/ndcg@10"] <= 1
    assert full != pooled  # the documents' pooled vectors score otherwise


def _document_token_counts(saved) -> list[int]:
    """Each corpus document's token vectors as the model encodes them (no pooling), counted apart from the command."""
    from vembed.data.corpus import CorpusSource
    from vembed.models.encoding import encode_sides
    from vembed.models.foreign import load_embedding_model
    from vembed.models.token_vectors import token_mask

    adapter = load_embedding_model(str(saved / "model"))
    sides = CorpusSource(None, str(saved / "corpus"), "train", None, "--split").load().corpus.sides
    return token_mask(encode_sides(adapter, sides, batch_size=8)).sum(dim=1).tolist()


def test_eval_reports_the_index_size_a_pool_factor_gives(saved, tmp_path, capsys):
    """--pool-factor promises a smaller index (about 1/factor of the token vectors): the command prints and writes
    what the index holds, pooled and unpooled (float16 vectors of 16 dims, and one int64 length per document)."""
    counts = _document_token_counts(saved)
    dim, documents = 16, len(counts)
    reports, lines = {}, {}
    for factor in (1, 3):
        out = tmp_path / f"factor{factor}.json"
        assert main(["eval", str(saved / "model"), str(saved / "corpus"), "--split", "train", "--pool-factor",
                     str(factor), "--output", str(out)]) == 0
        captured = capsys.readouterr()
        printed, lines[factor] = json.loads(captured.out), captured.err
        reports[factor] = json.loads(out.read_text())
        assert {k: v for k, v in printed.items() if k.startswith("index/")} == \
            {k: v for k, v in reports[factor].items() if k.startswith("index/")}
    pooled_counts = [max(1, n // 3) for n in counts]
    for factor, stored in ((1, counts), (3, pooled_counts)):
        assert reports[factor]["index/token_vectors"] == sum(stored)
        assert reports[factor]["index/bytes"] == sum(stored) * dim * 2 + documents * 8
        assert reports[factor]["index/token_vectors_unpooled"] == sum(counts)
        assert reports[factor]["index/bytes_unpooled"] == sum(counts) * dim * 2 + documents * 8
    assert reports[3]["index/bytes"] < 0.45 * reports[3]["index/bytes_unpooled"]
    assert f"index: {sum(counts):,} token vectors of {documents} documents" in lines[1] and "not pooled" in lines[1]
    assert f"index: {sum(pooled_counts):,} token vectors" in lines[3]
    assert f"pooled by 3 from {sum(counts):,} token vectors" in lines[3]


def test_mine_writes_negatives_scored_by_maxsim(saved, tmp_path, capsys):
    out = tmp_path / "negatives.jsonl"
    assert main(["mine", str(saved / "model"), str(saved / "corpus"), "--out", str(out), "--range-min", "1",
                 "--range-max", "10", "--max-score-ratio", "none", "--num-negatives", "2",
                 "--documents-per-block", "8"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(len(row["negatives"]) == 2 for row in rows)
    assert all(row["positive_score"] > 1 for row in rows)  # a sum over query tokens: beyond any cosine
    printed = capsys.readouterr().out
    assert "search: exact (torch, MaxSim)" in printed and "5 block(s) encoded" in printed  # faiss auto: not used


def test_mine_reports_the_index_size_a_pool_factor_gives_also_from_its_cache(saved, tmp_path, capsys):
    """The same promise as `vembed eval`'s: mining prints what its index holds; the second run reads every block
    from the cache, which keeps each block's unpooled count."""
    counts = _document_token_counts(saved)
    pooled = sum(max(1, n // 3) for n in counts)
    out = tmp_path / "negatives.jsonl"
    for reused in ("0 reused", "5 reused"):
        assert main(["mine", str(saved / "model"), str(saved / "corpus"), "--out", str(out), "--range-min", "1",
                     "--range-max", "10", "--max-score-ratio", "none", "--num-negatives", "2", "--pool-factor", "3",
                     "--documents-per-block", "8", "--overwrite"]) == 0
        printed = capsys.readouterr().out
        assert reused in printed
        assert f"index: {pooled:,} token vectors of {len(counts)} documents" in printed
        assert f"pooled by 3 from {sum(counts):,} token vectors" in printed


@pytest.mark.parametrize("command, expected", [
    (["eval", "{model}", "{pairs}", "--output", "{out}"],
     "model_dir: vembed eval of pair files scores one vector per side, and this model gives token vectors "
     "(multi_vector): evaluate it on a corpus folder"),
    (["mine", "{model}", "{corpus}", "--out", "{out}", "--faiss", "yes"],
     "--faiss: {model} gives token vectors (multi_vector), scored exactly by MaxSim; faiss's flat index"),
    (["export", "{model}", "--out", "{out}"], "is a multi_vector (ColBERT) model"),
    (["eval", "{model}", "{corpus}", "--pool-factor", "0", "--output", "{out}"], "--pool-factor: must be at least 1"),
])
def test_a_dense_only_command_refuses_a_multi_vector_model_in_one_line(saved, tmp_path, capsys, command, expected):
    places = {"model": str(saved / "model"), "pairs": str(saved / "pairs.jsonl"), "corpus": str(saved / "corpus"),
              "out": str(tmp_path / "out")}
    code = main([part.format(**places) for part in command])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected.format(**places) in err, err
    assert list(tmp_path.iterdir()) == []  # no output, no cache folder
