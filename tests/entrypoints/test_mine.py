"""`vembed mine`: a saved model and a corpus folder in, a training file out that vembed's training reads directly;
bad input is one line and exit 2, with nothing written."""

from __future__ import annotations

import json

import pytest

from vembed.cli import main
from vembed.data.corpus import write_corpus_folder

TOPICS = ["red square", "blue circle", "green triangle", "yellow star", "black line", "white page"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random-init text model saved by vembed, and a corpus folder of 60 documents and 6 queries."""
    from transformers import AutoTokenizer

    from vembed.components import recipe_from_dict
    from vembed.data.tokenizer import special_token_ids
    from vembed.models import MODELS

    root = tmp_path_factory.mktemp("mine")
    ids = special_token_ids(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    recipe = recipe_from_dict({"model_type": "text", "tokenizer_name": tiny_tokenizer_dir, "max_length": 16,
                               "model_config": {"model_type": "bert", "hidden_size": 32, "intermediate_size": 37,
                                                "num_hidden_layers": 1, "num_attention_heads": 4,
                                                "max_position_embeddings": 16, **ids}})
    MODELS.get("text").from_recipe(recipe).save(root / "model")
    docs = {f"d{i}": {"text": f"a photo of a {TOPICS[i % 6]} number {i}"} for i in range(60)}
    queries = {f"q{t}": {"text": f"a {topic}"} for t, topic in enumerate(TOPICS)}
    qrels = {"train": {f"q{t}": {f"d{t}": 1} for t in range(6)}, "test": {"q0": {"d0": 1}}}
    write_corpus_folder(root / "corpus", docs, queries, qrels)
    return root


def _mine(setup, out, *extra: str) -> int:
    return main(["mine", str(setup / "model"), str(setup / "corpus"), "--out", str(out), "--range-min", "1",
                 "--range-max", "30", "--max-score-ratio", "1.0", "--num-negatives", "3", "--batch-size", "16",
                 "--documents-per-block", "16", "--faiss", "no", *extra])


def test_mine_writes_rows_that_training_reads_as_hard_negatives(setup, tmp_path, capsys):
    out = tmp_path / "negatives.jsonl"
    assert _mine(setup, out) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and {"query_id", "positive_id", "negative_ids", "negative_scores", "query", "positive",
                     "negatives"} <= set(rows[0])
    for row in rows:
        assert row["positive_id"] not in row["negative_ids"] and len(row["negatives"]) == 3
    assert f"{out}: {len(rows)} rows" in printed and "4 block(s) encoded, 0 reused" in printed

    # Mining again (other thresholds; none: complete judgements) reads every block from the cache.
    assert _mine(setup, out, "--overwrite", "--range-min", "0", "--max-score-ratio", "none") == 0
    printed = capsys.readouterr().out
    assert "0 block(s) encoded, 4 reused" in printed and "no score threshold" in printed

    from vembed.data.sources import load_examples
    from vembed.recipe import DataConfig

    examples, report = load_examples(DataConfig(train=str(out)), "train", num_hard_negatives=3)
    assert len(examples) == len(rows) and len(examples[0].negatives) == 3

    # ... and by id, for training from the corpus folder itself (data.hard_negatives): the same texts.
    from vembed.data.corpus import CorpusPairs, load_corpus_split, read_hard_negatives

    rows = [json.loads(line) for line in out.read_text().splitlines()]  # the second mining's
    split = load_corpus_split(setup / "corpus", "train")
    pairs = CorpusPairs(split, read_hard_negatives(out, split), num_negatives=3)
    by_id = {pairs.ids(i)[:2]: pairs[i] for i in range(len(pairs))}
    for row in rows:
        record = by_id[(row["query_id"], row["positive_id"])]
        assert [n.text for n in record.negatives] == row["negatives"] and record.query.text == row["query"]


@pytest.mark.parametrize("change, expected", [
    ({"corpus": "missing"}, "is not a corpus folder"),
    ({"--split": "dev"}, "has no qrels/dev.tsv (splits here: test, train)"),
    ({"--range-min": "30"}, "--range-min: must be below --range-max (30)"),
    ({"--max-score-ratio": "1.5"}, "--max-score-ratio: must be in (0, 1]"),
    ({"--max-score-ratio": "0"}, "--max-score-ratio: must be in (0, 1]"),
    ({"model": "missing"}, "is not a folder"),
    ({"out": "exists"}, "exists; pass --overwrite"),
    ({"cache": "foreign"}, "holds docs-0000000000-0000000004.pt and 0 more block file(s) without vembed's"),
])
def test_bad_input_is_one_line_and_exit_2(setup, tmp_path, capsys, change, expected):
    out = tmp_path / "negatives.jsonl"
    if change.pop("out", None):
        out.write_text("keep me\n")
    cache = tmp_path / "my-blocks"
    if change.pop("cache", None):  # block files vembed did not write: opening the cache would delete them
        cache.mkdir()
        (cache / "docs-0000000000-0000000004.pt").write_text("keep me")
        change["--cache-dir"] = str(cache)
    model = str(tmp_path / "nope") if change.pop("model", None) else str(setup / "model")
    corpus = str(tmp_path / "nope") if change.pop("corpus", None) else str(setup / "corpus")
    flags = [item for pair in change.items() for item in pair]
    code = main(["mine", model, corpus, "--out", str(out), "--range-max", "30", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists() or out.read_text() == "keep me\n"
    assert not (tmp_path / "negatives.jsonl.cache").exists()
    assert not cache.exists() or (cache / "docs-0000000000-0000000004.pt").read_text() == "keep me"


WORDS = "red blue green yellow black white small empty square circle triangle star lines page digit seven".split()


@pytest.fixture(scope="module")
def distinct(setup, tmp_path_factory):
    """setup's model with a corpus whose 64 documents are distinct word sequences the tokenizer knows (no ties)."""
    import itertools

    root = tmp_path_factory.mktemp("distinct")
    combos = list(itertools.permutations(WORDS, 3))[::53][:64]
    docs = {f"d{i}": {"text": " ".join(words)} for i, words in enumerate(combos)}
    queries = {f"q{i}": {"text": " ".join(combos[i * 7][:2])} for i in range(8)}
    write_corpus_folder(root / "corpus", docs, queries, {"train": {f"q{i}": {f"d{i * 7}": 1} for i in range(8)}})
    (root / "model").symlink_to(setup / "model")
    return root


def _launch(setup, out, *launcher: str):
    import os
    import subprocess
    import sys

    from launching import free_port

    from vembed.resources import accelerate_configs

    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--main_process_port",
               str(free_port()), "-m", "vembed", "mine", str(setup / "model"), str(setup / "corpus"), "--out",
               str(out), "--range-min", "1", "--range-max", "30", "--max-score-ratio", "1.0", "--num-negatives", "3",
               "--batch-size", "4", "--documents-per-block", "8", "--faiss", "no", "--no-cache"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(accelerate_configs().parent))


@pytest.mark.slow
def test_two_processes_launched_by_accelerate_mine_what_one_process_mines(distinct, tmp_path):
    from vembed.resources import accelerate_configs

    setup = distinct
    one = tmp_path / "one.jsonl"
    assert main(["mine", str(setup / "model"), str(setup / "corpus"), "--out", str(one), "--range-min", "1",
                 "--range-max", "30", "--max-score-ratio", "1.0", "--num-negatives", "3", "--batch-size", "4",
                 "--documents-per-block", "8", "--faiss", "no", "--no-cache"]) == 0
    two = tmp_path / "two.jsonl"
    done = _launch(setup, two, "--config_file", str(accelerate_configs() / "ddp_cpu.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout, done.stdout[-2000:]
    rows_one = [json.loads(line) for line in one.read_text().splitlines()]
    rows_two = [json.loads(line) for line in two.read_text().splitlines()]
    assert len(rows_one) == 8
    assert [r["negative_ids"] for r in rows_two] == [r["negative_ids"] for r in rows_one]
    for a, b in zip(rows_two, rows_one):
        assert a["negative_scores"] == pytest.approx(b["negative_scores"], abs=1e-5)


@pytest.mark.slow
def test_a_launch_that_starts_fewer_processes_than_promised_is_one_line(setup, tmp_path):
    out = tmp_path / "negatives.jsonl"
    done = _launch(setup, out, "--cpu", "--num_processes", "2")  # accelerate starts ONE process for this
    assert done.returncode != 0, done.stderr[-3000:]  # ours is 2; accelerate's launcher turns it into its own 1
    said = "launch error: accelerate launch promised 2 processes (--num_processes 2) but 1 started"
    assert said in done.stderr, done.stderr[-2000:]
    assert not out.exists()


def test_training_on_a_corpus_with_what_mine_wrote_runs_when_mine_left_queries_out(tmp_path, tiny_tokenizer_dir,
                                                                                  capsys):
    """The miner leaves out queries with fewer than --num-negatives candidates on purpose; training from the corpus
    folder with its file (data.hard_negatives) leaves those pairs out as short, not as bad data past
    data.max_bad_fraction, with data.num_hard_negatives unset or the miner's number (issue 22 item 2)."""
    import math

    from corpora import make_corpus_folder, text_model_keys

    from vembed.components import recipe_from_dict
    from vembed.models import MODELS
    from vembed.training.loop import Trainer

    folder = make_corpus_folder(tmp_path / "corpus")
    MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tiny_tokenizer_dir))).save(tmp_path / "model")
    out = tmp_path / "negatives.jsonl"
    # 36 documents: a query with 2 relevant ones has 34 candidates, fewer than 35, and is left out.
    assert main(["mine", str(tmp_path / "model"), str(folder), "--out", str(out), "--range-min", "0", "--range-max",
                 "35", "--num-negatives", "35", "--max-score-ratio", "none", "--faiss", "no", "--no-cache"]) == 0
    printed = capsys.readouterr().out
    assert "from 7 of 10 queries" in printed and "3 queries had fewer than 35 negatives left" in printed, printed
    for num_hard_negatives in (None, 35):
        data = {"train": str(folder), "hard_negatives": str(out), "num_hard_negatives": num_hard_negatives}
        raw = {**text_model_keys(tiny_tokenizer_dir), "data": data, "batch_size": 4,
               "output_dir": str(tmp_path / f"run{num_hard_negatives}"), "max_steps": 1, "learning_rate": 1e-3,
               "seed": 0, "eval_before_training": False}
        metrics = Trainer(recipe_from_dict(raw)).run().metrics["train"]
        assert metrics["steps"] == 1 and math.isfinite(metrics["final_loss"])
        assert metrics["data"]["num_hard_negatives"] == 35  # unset: what the miner wrote, not 0
        report = metrics["data"]
        assert (report["kept"], report["short_of_negatives"], report["skipped"]) == (7, 6, {})
