"""Hard-negative mining: positives never become negatives, the rank window and the positive-aware threshold hold,
two ranks mine what one does, an interrupted job resumes from its cache without re-encoding, and a changed corpus or
model never reuses stale embeddings."""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch
from ranks import run_on_ranks
from tiny_models import hashing_encoder

from vembed.data.corpus import CORPUS_FILE, load_corpus_split, write_corpus_folder
from vembed.retrieval.cache import EmbeddingCache, cache_key
from vembed.retrieval.mining import MiningSettings, MiningStats, mine_hard_negatives, select_negatives
from vembed.retrieval.scoring import top_k


class _Lookup(torch.nn.Module):
    """A stand-in adapter: each text's embedding is given (a dict text -> vector)."""

    def __init__(self, vectors: dict[str, list[float]]):
        super().__init__()
        self.vectors = vectors
        self.embedding_dim = len(next(iter(vectors.values())))
        self.rows_encoded = 0

    def preprocess(self, sides):
        return {"vectors": torch.tensor([self.vectors[s.text] for s in sides], dtype=torch.float32)}

    def forward(self, inputs):
        self.rows_encoded += len(inputs["vectors"])
        return inputs["vectors"]


def _at(score: float) -> list[float]:
    """A unit 2-d vector whose cosine with (1, 0) is `score`."""
    return [score, math.sqrt(max(0.0, 1 - score * score))]


# The query is (1, 0); each document's cosine with it is its name's number.
SCORES = {"pos": 0.8, "d99": 0.99, "d90": 0.9, "d78": 0.78, "d75": 0.75, "d70": 0.7, "d60": 0.6, "d50": 0.5,
          "d40": 0.4}


def test_negatives_skip_positives_and_keep_the_rank_window_below_the_threshold():
    names = list(SCORES)
    docs = torch.tensor([_at(SCORES[n]) for n in names])
    found = top_k(torch.tensor([[1.0, 0.0]]), docs, len(names))
    settings = MiningSettings(range_min=1, range_max=6, max_score_ratio=0.95, num_negatives=3)
    stats = MiningStats()
    (mined,) = select_negatives(found, [[names.index("pos")]], [0.8], settings, stats)
    # Non-relevant by rank: d99 (rank 0, below range_min), d90 d78 d75 d70 d60 (ranks 1-5), d50 d40 (past range_max).
    # The threshold 0.95 x 0.8 = 0.76 drops d90 and d78; the positive (0.8) is never a candidate.
    assert [names[i] for i in mined.negatives] == ["d75", "d70", "d60"]
    assert mined.scores == pytest.approx([0.75, 0.7, 0.6], abs=1e-6)
    assert (stats.candidates, stats.dropped_by_threshold, stats.mined) == (5, 2, 1)
    # Asking for more than the filters leave: the query is left out, not padded with what they dropped.
    (short,) = select_negatives(found, [[names.index("pos")]], [0.8], MiningSettings(1, 6, 0.95, 4))
    assert short is None
    # Ratio 1: only candidates above the positive itself go (d99 is outside the window already, d90 goes).
    (loose,) = select_negatives(found, [[names.index("pos")]], [0.8], MiningSettings(1, 6, 1.0, 4))
    assert [names[i] for i in loose.negatives] == ["d78", "d75", "d70", "d60"]
    # No threshold (complete judgements): the window alone decides, d90 included.
    (unfiltered,) = select_negatives(found, [[names.index("pos")]], [0.8], MiningSettings(1, 6, None, 4))
    assert [names[i] for i in unfiltered.negatives] == ["d90", "d78", "d75", "d70"]


def _folder(tmp_path, documents: dict[str, str], queries: dict[str, str], qrels: dict[str, dict[str, int]]):
    return write_corpus_folder(tmp_path / "corpus", {d: {"text": t} for d, t in documents.items()},
                               {q: {"text": t} for q, t in queries.items()}, {"train": qrels})


def test_mining_a_corpus_folder_skips_every_graded_positive_and_measures_against_the_lowest(tmp_path):
    # q1 has two positives (grades 2 and 1, scores 0.8 and 0.72) and one judged non-relevant document (grade 0).
    scores = {**SCORES, "pos2": 0.72, "judged0": 0.65}
    vectors = {name: _at(s) for name, s in scores.items()} | {"query one": [1.0, 0.0]}
    folder = _folder(tmp_path, {name: name for name in scores}, {"q1": "query one"},
                     {"q1": {"pos": 2, "pos2": 1, "judged0": 0}})
    split = load_corpus_split(folder, "train")
    rows, stats = mine_hard_negatives(_Lookup(vectors), split, MiningSettings(0, 20, 0.95, 3), batch_size=3,
                                      documents_per_block=4)
    # Threshold from the lower positive: 0.95 x 0.72 = 0.684, so d99 .. d70 go; grade 0 is a fine negative.
    assert [(r["query_id"], r["positive_id"]) for r in rows] == [("q1", "pos"), ("q1", "pos2")]
    for row in rows:
        assert row["negative_ids"] == ["judged0", "d60", "d50"]
        assert row["negatives"] == ["judged0", "d60", "d50"] and row["query"] == "query one"
        assert row["positive"] == row["positive_id"]
        assert not {"pos", "pos2"} & set(row["negative_ids"])
    assert rows[0]["positive_score"] == pytest.approx(0.8, abs=1e-6)
    assert stats.dropped_by_threshold == 5 and stats.blocks_encoded == 3


def _random_folder(root, changed: str | None = None):
    docs = {f"d{i}": f"document {i} about {'abcdefghij'[i % 10] * (i % 7 + 1)}" for i in range(203)}
    if changed:
        docs["d5"] = changed
    # Each query nearly copies its positive's text, so the positive scores high and the threshold leaves candidates.
    queries = {f"q{i}": docs[f"d{7 * i}"] + " ?" for i in range(11)}
    qrels = {f"q{i}": {f"d{7 * i}": 1} for i in range(11)}
    return write_corpus_folder(root, {d: {"text": t} for d, t in docs.items()},
                               {q: {"text": t} for q, t in queries.items()}, {"train": qrels})


SETTINGS = MiningSettings(range_min=2, range_max=40, max_score_ratio=1.0, num_negatives=5)


def _mine(folder, **kwargs):
    model = kwargs.pop("model", None) or hashing_encoder()
    rows, stats = mine_hard_negatives(model, load_corpus_split(folder, "train"), SETTINGS, batch_size=8,
                                      documents_per_block=20, **kwargs)
    return rows, stats, model


def _mine_on_ranks(folder: str, cache_dir: str, out_file: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    cache = EmbeddingCache(cache_dir, {"test": 1}).open(accelerator)
    rows, stats, model = _mine(folder, accelerator=accelerator, cache=cache)
    assert model.rows_encoded < 203  # each rank encoded its share of the corpus (plus all 11 queries' share)
    if accelerator.is_main_process:
        with open(out_file, "w") as handle:
            json.dump(rows, handle)


def test_two_ranks_mine_what_one_process_mines(tmp_path):
    folder = _random_folder(tmp_path / "corpus")
    expected, stats, _ = _mine(folder)
    assert len(expected) == 11 and stats.mined == 11
    out = tmp_path / "rows.json"
    run_on_ranks(_mine_on_ranks, str(folder), str(tmp_path / "cache"), str(out), world=2, timeout=120)
    found = json.loads(out.read_text())
    assert [r["negative_ids"] for r in found] == [r["negative_ids"] for r in expected]
    assert found == json.loads(json.dumps(expected))


class _Killed(Exception):
    pass


def test_an_interrupted_mining_resumes_from_the_cache_without_re_encoding_finished_blocks(tmp_path):
    folder = _random_folder(tmp_path / "corpus")
    expected, _, _ = _mine(folder)
    key = {"model": "hashing", "corpus": "random"}
    original_store = EmbeddingCache.store
    calls = []

    def store_then_kill(self, start, stop, emb):
        original_store(self, start, stop, emb)
        calls.append(start)
        if len(calls) == 4:
            raise _Killed  # as a kill right after the 4th block is on disk

    with mock.patch.object(EmbeddingCache, "store", store_then_kill), pytest.raises(_Killed):
        _mine(folder, cache=EmbeddingCache(tmp_path / "cache", key).open())
    assert len(list((tmp_path / "cache").glob("docs-*.pt"))) == 4

    rows, stats, model = _mine(folder, cache=EmbeddingCache(tmp_path / "cache", key).open())
    assert rows == expected
    assert (stats.blocks_reused, stats.blocks_encoded) == (4, 7)  # 203 documents in blocks of 20
    assert model.rows_encoded == 11 + 203 - 80  # the queries, and only the documents of the 7 unfinished blocks

    again, stats, model = _mine(folder, cache=EmbeddingCache(tmp_path / "cache", key).open())
    assert again == expected and stats.blocks_encoded == 0 and model.rows_encoded == 11


def test_a_changed_corpus_or_model_empties_the_cache(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights.bin").write_bytes(b"one")
    folder = _random_folder(tmp_path / "corpus")

    def cache():
        return EmbeddingCache(tmp_path / "cache", cache_key(model_dir, folder / CORPUS_FILE)).open()

    _mine(folder, cache=cache())
    same = cache()
    _, stats, _ = _mine(folder, cache=same)
    assert stats.blocks_reused == 11 and not same.invalidated

    # One document edited, same length: its block's embeddings would be stale.
    _random_folder(tmp_path / "corpus", changed="document 5 about ffffff"[::-1])
    edited = cache()
    rows, stats, _ = _mine(folder, cache=edited)
    assert edited.invalidated and stats.blocks_reused == 0 and stats.blocks_encoded == 11
    assert rows == _mine(folder)[0]

    (model_dir / "weights.bin").write_bytes(b"two")  # the model saved again
    retrained = cache()
    _, stats, _ = _mine(folder, cache=retrained)
    assert retrained.invalidated and stats.blocks_reused == 0


def test_faiss_finds_the_negatives_exact_search_finds(tmp_path):
    pytest.importorskip("faiss", reason="pip install faiss-cpu for the faiss path")
    folder = _random_folder(tmp_path / "corpus")
    exact, _, _ = _mine(folder)
    with_faiss, _, _ = _mine(folder, use_faiss=True)
    assert [r["negative_ids"] for r in with_faiss] == [r["negative_ids"] for r in exact]
    for a, b in zip(with_faiss, exact):
        assert a["negative_scores"] == pytest.approx(b["negative_scores"], abs=1e-5)


def test_settings_that_cannot_work_are_one_error_naming_the_flag():
    from vembed.errors import RecipeError

    for settings, flag in ((MiningSettings(range_min=100, range_max=100), "--range-min"),
                           (MiningSettings(max_score_ratio=0.0), "--max-score-ratio"),
                           (MiningSettings(max_score_ratio=1.5), "--max-score-ratio"),
                           (MiningSettings(num_negatives=0), "--num-negatives")):
        with pytest.raises(RecipeError, match=flag):
            settings.check()


RANGE_MIN, RANGE_MAX, NEGATIVES, MARGIN = 3, 15, 4, 0.005


@pytest.fixture(scope="module")
def st_mining_setup(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny sentence-transformers model saved to disk (vembed reads the same folder, vembed/models/foreign.py), and
    a corpus folder of 80 distinct documents and 20 queries (every fifth with two positives), as (query, positive)
    pairs for sentence-transformers."""
    import itertools

    from tiny_models import save_sentence_transformers_folder, save_transformers_folder

    root = tmp_path_factory.mktemp("st_mining")
    model = save_sentence_transformers_folder(root / "st", save_transformers_folder(root / "hf", tiny_tokenizer_dir),
                                              pooling="mean", max_seq_length=16)
    words = "red blue green yellow black white small empty square circle triangle star lines page digit seven".split()
    combos = list(itertools.permutations(words, 3))[::37][:80]
    docs = {f"d{i}": {"text": " ".join(w)} for i, w in enumerate(combos)}
    queries = {f"q{i}": {"text": " ".join(combos[i * 4][:2])} for i in range(20)}
    qrels = {f"q{i}": {f"d{i * 4}": 1, **({f"d{i * 4 + 1}": 1} if i % 5 == 0 else {})} for i in range(20)}
    assert len({q["text"] for q in queries.values()}) == 20  # rows are matched by their texts
    write_corpus_folder(root / "corpus", docs, queries, {"train": qrels})
    pairs = [(queries[q]["text"], docs[d]["text"]) for q, judged in qrels.items() for d in judged]
    return {"model": model, "corpus": root / "corpus", "pairs": pairs, "documents": [d["text"] for d in docs.values()],
            "root": root}


def _vembed_mine(setup, order: str) -> dict:
    from vembed.cli import main

    out = setup["root"] / f"{order}.jsonl"
    assert main(["mine", setup["model"], str(setup["corpus"]), "--out", str(out), "--overwrite", "--range-min",
                 str(RANGE_MIN), "--range-max", str(RANGE_MAX), "--num-negatives", str(NEGATIVES),
                 "--max-score-ratio", str(1 - MARGIN), "--filter-order", order, "--faiss", "no", "--no-cache"]) == 0
    return {(row["query"], row["positive"]): row["negatives"] for row in map(json.loads, out.read_text().splitlines())}


def _st_mine(setup, **settings) -> list[dict]:
    st = pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    dataset = Dataset.from_dict({"anchor": [q for q, _ in setup["pairs"]], "positive": [p for _, p in setup["pairs"]]})
    model = st.SentenceTransformer(setup["model"], device="cpu", local_files_only=True)
    return list(mine_hard_negatives(dataset, model, corpus=setup["documents"], range_min=RANGE_MIN,
                                    range_max=RANGE_MAX, sampling_strategy="top", output_format="n-tuple",
                                    verbose=False, **settings))


def test_threshold_first_mines_what_sentence_transformers_relative_margin_mines(st_mining_setup):
    rows = _st_mine(st_mining_setup, relative_margin=MARGIN, num_negatives=NEGATIVES)
    theirs = {(r["anchor"], r["positive"]): [r[f"negative_{i + 1}"] for i in range(NEGATIVES)] for r in rows}
    assert 0 < len(theirs) < len(st_mining_setup["pairs"])  # the threshold leaves some queries short
    assert _vembed_mine(st_mining_setup, "threshold-first") == theirs


def test_window_first_mines_sentence_transformers_window_then_the_same_threshold(st_mining_setup):
    """vembed's default order, from sentence-transformers' window (no margin: every candidate of ranks
    range_min..range_max, with scores) with the same relative threshold applied inside it afterwards."""
    from vembed.retrieval.mining import score_threshold

    window = RANGE_MAX - RANGE_MIN
    rows = _st_mine(st_mining_setup, num_negatives=window, output_scores=True)
    lowest_positive: dict[str, float] = {}
    for row in rows:
        lowest_positive[row["anchor"]] = min(row["scores"][0], lowest_positive.get(row["anchor"], math.inf))
    theirs = {}
    for row in rows:
        threshold = score_threshold(lowest_positive[row["anchor"]], 1 - MARGIN)
        kept = [row[f"negative_{i + 1}"] for i in range(window) if row["scores"][i + 1] <= threshold][:NEGATIVES]
        if len(kept) == NEGATIVES:
            theirs[(row["anchor"], row["positive"])] = kept
    ours = _vembed_mine(st_mining_setup, "window-first")
    assert 0 < len(ours) < len(st_mining_setup["pairs"]) and ours == theirs
    # The two orders are different rules: on this corpus they disagree on most queries.
    other = _vembed_mine(st_mining_setup, "threshold-first")
    assert sum(ours.get(key) != other.get(key) for key in ours.keys() | other.keys()) > len(ours) // 2
