"""`vembed eval` launched like `vembed train` (--accelerate_config NAME|FILE): one plain process evaluates in the
launcher; several processes each encode their share of the corpus and give the metrics of one process, printed and
written once (rank 0)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from corpora import make_corpus_folder, text_model_keys

from vembed.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_and_corpus(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random-init text model saved by vembed, and the 36-document corpus folder of tests/corpora.py."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    root = tmp_path_factory.mktemp("eval")
    MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tiny_tokenizer_dir))).save(root / "model")
    return root / "model", make_corpus_folder(root / "corpus")


def _metrics_printed(text: str) -> int:
    return text.count('"corpus/ndcg@10"')


def test_a_one_process_config_evaluates_in_the_launcher_and_prints_once(model_and_corpus, tmp_path, capsys):
    model, corpus = model_and_corpus
    plain, launched = tmp_path / "plain.json", tmp_path / "launched.json"
    assert main(["eval", str(model), str(corpus), "--output", str(plain)]) == 0
    capsys.readouterr()
    assert main(["eval", str(model), str(corpus), "--output", str(launched), "--accelerate_config", "single"]) == 0
    out, err = capsys.readouterr()
    assert "launching 1 process(es) with" in err and "(in this process)" in err
    assert _metrics_printed(out) == 1
    assert json.loads(launched.read_text()) == json.loads(plain.read_text())


def test_a_process_a_launch_started_does_not_launch_again(monkeypatch):
    import argparse

    from vembed.entrypoints import evaluate
    from vembed.training.launch_promise import LAUNCHER_PID_ENV

    monkeypatch.setattr("vembed.training.launch_promise._parent_accelerate_launch_arguments", lambda: None)
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    args = argparse.Namespace(accelerate_config="ddp_cpu", num_processes=None)
    assert evaluate._asks_for_a_launch(args)
    assert not evaluate._asks_for_a_launch(argparse.Namespace(accelerate_config=None, num_processes=None))
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getppid()))
    assert not evaluate._asks_for_a_launch(args)


@pytest.mark.slow
def test_two_processes_give_one_process_metrics_printed_once(model_and_corpus, tmp_path):
    from deadline import limit, run_with_deadline
    from launching import ENV, LAUNCH_TIMEOUT

    model, corpus = model_and_corpus
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(["eval", str(model), str(corpus), "--batch-size", "4", "--output", str(one)]) == 0
    command = [sys.executable, "-m", "vembed", "eval", str(model), str(corpus), "--batch-size", "4", "--output",
               str(two), "--accelerate_config", "ddp_cpu"]
    done = run_with_deadline(command, cwd=ROOT, env=ENV, timeout=limit(LAUNCH_TIMEOUT), log_dir=tmp_path / "logs")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launching 2 process(es)" in done.stderr
    assert _metrics_printed(done.stdout) == 1, done.stdout
    expected, got = json.loads(one.read_text()), json.loads(two.read_text())
    assert set(got) == set(expected) and expected["num_queries"] > 1
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    assert json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1]) == got


def test_named_sources_are_each_evaluated_apart_with_their_scored_metrics(model_and_corpus, tmp_path, capsys):
    # NAME=PATH: each source's metrics as if evaluated alone, under its name; the keys every source has, averaged.
    model, _ = model_and_corpus
    graded = [{"query": f"a red shape number {i}", "positive": f"shape {i} in red", "score": (i * 7 % 5) / 4}
              for i in range(8)]
    triplets = [{"query": f"a blue circle {i}", "positive": f"circle {i}", "negatives": [f"square {i + 1}"]}
                for i in range(6)]
    files = {}
    for name, rows in (("sts", graded), ("triplets", triplets)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    alone = {}
    for name, path in files.items():
        assert main(["eval", str(model), str(path), "--output", str(tmp_path / f"{name}.json")]) == 0
        alone[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert main(["eval", str(model), *(f"{name}={path}" for name, path in files.items()), "--output",
                 str(tmp_path / "both.json")]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    assert "similarity/spearman_cosine" in alone["sts"] and "triplet/cosine_accuracy" in alone["triplets"]
    for name, metrics in alone.items():
        for key, value in metrics.items():
            assert both[f"{name}/{key}"] == pytest.approx(value, abs=1e-6), (name, key)
    assert both["q2d/mrr"] == pytest.approx((alone["sts"]["q2d/mrr"] + alone["triplets"]["q2d/mrr"]) / 2)
    assert "similarity/spearman_cosine" not in both  # only one source has scores: reported under its name only
    capsys.readouterr()
    assert main(["eval", str(model), f"sts={files['sts']}", str(files["triplets"])]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no NAME= while other data arguments do" in err and "\n" not in err


def test_a_corpus_folder_and_pair_files_named_together_are_each_evaluated_as_alone(model_and_corpus, tmp_path,
                                                                                    capsys):
    """NAME=FOLDER beside NAME=PAIRS: the folder searched as `vembed eval MODEL FOLDER` searches it, the pairs as
    alone; --split reaches the folder, pair-only flags the pairs; the flags of neither kind stay refused."""
    model, corpus = model_and_corpus
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": f"a blue circle {i}", "positive": f"circle {i}"}) + "\n"
                             for i in range(6)))
    alone = {}
    for name, data in (("beir", corpus), ("pairs", pairs)):
        assert main(["eval", str(model), str(data), "--output", str(tmp_path / f"{name}.json")]) == 0
        alone[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert main(["eval", str(model), f"beir={corpus}", f"pairs={pairs}", "--split", "test", "--mrl-dims", "8",
                 "--output", str(tmp_path / "both.json")]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    assert "corpus/ndcg@10" in alone["beir"] and "q2d/mrr" in alone["pairs"]
    for name, metrics in alone.items():
        for key, value in metrics.items():
            assert both[f"{name}/{key}"] == pytest.approx(value, abs=1e-6), (name, key)
    assert list(both)[0].startswith("beir/")  # the order given
    assert "corpus/ndcg@10" not in both and "q2d/mrr" not in both  # no key both kinds have: no mean
    assert both["num_queries"] == alone["beir"]["num_queries"] + alone["pairs"]["num_queries"]  # sizes: totals
    assert "pairs/q2d/dim8/mrr" in both and not any("dim8" in key for key in alone["pairs"])  # --mrl-dims: pairs
    capsys.readouterr()
    assert main(["eval", str(model), f"beir={corpus}", "--column", "query=text"]) == 2  # no pairs to map
    err = capsys.readouterr().err.strip()
    assert "--column" in err and "applies to pair files" in err and "\n" not in err
