"""The real command line: bad input → one line, exit 2, nothing written; a 2-process CPU launch trains end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT))


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_recipe(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"learnin_rate": 1e-4}, "learnin_rate"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"mrl_dims": [999]}, "mrl_dims"),
        ({"data": {"train": "no/such/file.jsonl"}}, "data.train"),
        ({"model_config": None, "model_name": "no/such-local-model"}, "model_name"),
    ],
    ids=["unknown-key", "negative-lr", "mrl-too-big", "missing-data", "missing-model"],
)
def test_bad_recipe_is_one_line_exit_2_and_nothing_written(tiny_clip_recipe, tmp_path, change, expected):
    raw = {**tiny_clip_recipe, **change}
    result = _run([sys.executable, "run.py", str(_write_recipe(tmp_path, raw))], timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not Path(raw["output_dir"]).exists()


def test_rows_with_several_images_for_a_single_image_model_are_one_line_before_anything_is_written(
        tiny_clip_recipe, tmp_path):
    import json

    from PIL import Image

    for name in ("a", "b"):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    rows = [{"query": f"query {i}", "positive_image": "a.png"} for i in range(6)]
    rows.append({"query": "query 7", "positive_image": ["a.png", "b.png"]})
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    raw = {**tiny_clip_recipe, "data": {"train": str(train)}}
    result = _run([sys.executable, "-m", "vembed.entrypoints.train", str(_write_recipe(tmp_path, raw))], timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0] == (f"data error: {train}, row 7: the positive has 2 images; model_type clip embeds at most 1 "
                        "per side (qwen_vl takes several): give one image path per cell")
    assert "Traceback" not in result.stderr
    assert not Path(raw["output_dir"]).exists()


def test_debug_flag_shows_the_traceback(tiny_clip_recipe, tmp_path):
    recipe = _write_recipe(tmp_path, {**tiny_clip_recipe, "learnin_rate": 1})
    result = _run([sys.executable, "-m", "vembed.entrypoints.train", str(recipe), "--debug"], timeout=120)
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_cpu_flag_with_two_processes_is_refused_not_silently_single(tiny_clip_recipe, tmp_path):
    recipe = _write_recipe(tmp_path, tiny_clip_recipe)
    result = _run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
                   "vembed/entrypoints/train.py", str(recipe)])
    assert result.returncode != 0
    assert "promised 2 processes" in result.stderr and "ddp_cpu.yaml" in result.stderr


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_end_to_end(tiny_clip_recipe, tmp_path, capsys):
    raw = dict(tiny_clip_recipe, max_steps=4, save_steps=2, report_to=["tensorboard"], mrl_dims=[16, 8])
    recipe = _write_recipe(tmp_path, raw)
    result = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   "accelerate_configs/ddp_cpu.yaml", "--main_process_port", str(_free_port()),
                   "vembed/entrypoints/train.py", str(recipe), "--config_override", "learning_rate=5e-4"])
    assert result.returncode == 0, result.stderr[-3000:]
    out = Path(raw["output_dir"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["world_size"] == 2
    assert metrics["train"]["steps"] == 4
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert (out / "loss_curve.png").stat().st_size > 0 and (out / "accuracy_vs_dim.png").stat().st_size > 0
    assert "q2d/dim8/accuracy@1" in metrics["test"]
    assert yaml.safe_load((out / "recipe.yaml").read_text())["learning_rate"] == pytest.approx(5e-4)
    assert list((out / "logs").rglob("events.out.tfevents*")), "tensorboard tracker wrote nothing"

    import vembed

    model = vembed.load(str(out / "final"))
    emb = model.encode(texts=["a photo of a red square"])
    assert emb.shape == (1, 16) and abs(float(emb.norm()) - 1.0) < 1e-5

    # The commands in this process (a fresh interpreter each costs ~10 s of imports; `python -m vembed eval` runs
    # in a subprocess in tests/entrypoints/test_evaluate.py)
    from vembed.cli import main

    capsys.readouterr()
    assert main(["eval", str(out / "final"), raw["data"]["test"]]) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    cli_metrics = json.loads(printed[printed.index("{"):])
    assert cli_metrics["q2d/accuracy@1"] == pytest.approx(metrics["test"]["q2d/accuracy@1"], abs=1e-6)

    assert main(["export", str(out / "final"), "--out", str(tmp_path / "st")]) == 0, capsys.readouterr().err[-2000:]
    assert (tmp_path / "st" / "modules.json").is_file()


@pytest.mark.slow
def test_run_py_launches_two_cpu_processes_and_returns_their_exit_code(tiny_clip_recipe, tmp_path):
    """run.py validates, then runs accelerate's launcher in its own process (no second interpreter)."""
    raw = dict(tiny_clip_recipe, max_steps=2, save_steps=None, eval_before_training=False,
               data={"train": tiny_clip_recipe["data"]["train"]})
    result = _run([sys.executable, "run.py", str(_write_recipe(tmp_path, raw)), "--accelerate_config", "ddp_cpu"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((Path(raw["output_dir"]) / "metrics.json").read_text())
    assert (metrics["train"]["world_size"], metrics["train"]["steps"]) == (2, 2)

    # A file that only the training processes read (check_recipe sees that it exists) fails inside them: their
    # one-line error and exit code come back, with no traceback from the launcher.
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"query": "a", "positive": "b"}\n{not json\n')
    raw = dict(raw, output_dir=str(tmp_path / "failed"), data={"train": str(broken)})
    result = _run([sys.executable, "run.py", str(_write_recipe(tmp_path, raw)), "--accelerate_config", "ddp_cpu"])
    assert result.returncode == 2, result.stderr[-3000:]
    # One line: the failing rank's own error, naming the rank (both ranks read the file; either may be first).
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("launching ")]
    assert len(lines) == 1 and "line 2 is not valid JSON" in lines[0], result.stderr[-3000:]
    assert " of 2 failed first; the other ranks were stopped]" in lines[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not Path(raw["output_dir"]).exists()  # nothing written by a launch that failed


def test_data_command_writes_a_dummy_data_set(tmp_path):
    out = tmp_path / "dummy"
    result = _run([sys.executable, "-m", "vembed", "data", "dummy", "--out", str(out), "--num-samples", "40"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for split in ("train", "validation", "test")
            for line in (out / f"{split}.jsonl").read_text().splitlines()]
    assert len(rows) == 40
    assert all((out / row["positive_image"]).is_file() for row in rows)
    assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_eval_of_a_folder_that_is_not_a_model_is_one_line(tmp_path, dummy_data_dir):
    result = _run([sys.executable, "-m", "vembed", "eval", str(tmp_path), str(dummy_data_dir / "test.jsonl")])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "vembed.json" in result.stderr


@pytest.mark.parametrize("argv, says", [
    (["data", "dummy", "--num-samples", "0"], "--num-samples: must be at least 3"),
    (["data", "dummy", "--image-size", "0"], "--image-size: must be at least 8"),
    (["data", "digits", "--image-size", "-1"], "--image-size: must be at least 8"),
], ids=["no-samples", "no-pixels", "negative-size"])
def test_the_cli_helpers_answer_out_of_range_arguments_in_one_line(tmp_path, capsys, argv, says):
    from vembed.cli import main

    out = tmp_path / "data"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["dummy", "digits", "webdataset"])
def test_data_out_that_is_a_file_is_one_line(tmp_path, capsys, kind):
    from vembed.cli import main

    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    for out in (taken, taken / "data"):  # was a FileExistsError / NotADirectoryError traceback
        assert main(["data", kind, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--out: {out} cannot be a folder: {taken} is a file" in err and "\n" not in err, err
    assert taken.read_text() == "x"


def test_eval_and_export_arguments_out_of_range_are_one_line(tmp_path, capsys, dummy_data_dir):
    from vembed.cli import main

    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    test = str(dummy_data_dir / "test.jsonl")
    for argv, says in ((["eval", str(tmp_path), test, "--batch-size", "0"], "--batch-size: must be at least 1"),
                       (["eval", str(tmp_path), test, "--max-samples", "-3"], "--max-samples: must be at least 1"),
                       (["eval", str(tmp_path), test, "--output", str(taken / "m.json")], "taken.txt is a file"),
                       # a file there (a data file named by mistake) is replaced only when asked, as export and mine
                       (["eval", str(tmp_path), test, "--output", str(taken)],
                        "--output: " + str(taken) + " exists; pass --overwrite to replace it")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, err
    assert taken.read_text() == "x"


@pytest.mark.parametrize("case, expected", [
    ("text_score", "data.columns.score ('score'): score cell holds str 'high', not a number"),
    ("out_of_range", "row 3: data.columns.score ('score'): score 2 is outside data.score_range [0, 1]"),
    ("teacher_list_length", "a list of 3 teacher scores for a row with 1 hard negatives"),
    ("guide_does_not_load", "gist_guide"),
])
def test_bad_scores_and_guide_are_one_line_exit_2_and_nothing_written(tiny_clip_recipe, dummy_data_dir, tmp_path,
                                                                       case, expected):
    import json

    rows = [json.loads(line) for line in (dummy_data_dir / "train.jsonl").read_text().splitlines()][:8]
    raw = {**tiny_clip_recipe, "loss_type": "cosent"}
    for i, row in enumerate(rows):
        row["score"] = float(i % 5)
        row["negatives"] = [f"not {row['query']}"]
    if case == "text_score":
        rows[3]["score"] = "high"
    if case == "out_of_range":
        raw["data"] = {"score_range": [0, 1]}
    if case == "teacher_list_length":
        raw["loss_type"] = "distill_kl"
        for row in rows:
            row["score"] = [1.0, 0.5]
        rows[5]["score"] = [1.0, 0.5, 0.2]
    if case == "guide_does_not_load":
        raw.update(loss_type="gist", gist_guide=str(tmp_path))  # a folder, but no model in it
    train = tmp_path / "scored.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    raw["data"] = {**raw.get("data", {}), "train": str(train), "image_root": str(dummy_data_dir)}
    result = _run([sys.executable, "-m", "vembed.entrypoints.train", str(_write_recipe(tmp_path, raw))], timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not Path(raw["output_dir"]).exists()


def _options(parser, name="vembed"):
    """(command, option strings, help) of every option of every subcommand."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _options(child, f"{name} {sub}")
        elif action.option_strings and action.option_strings != ["-h", "--help"]:
            yield name, action.option_strings, action.help


def test_every_option_has_help_one_hyphenated_spelling_first_and_its_underscore_alias():
    from vembed.cli import build_parser

    bad = []
    for command, strings, help_text in _options(build_parser()):
        long = [s for s in strings if s.startswith("--")]
        words = long[0][2:]
        if not help_text:
            bad.append(f"{command} {long[0]}: no help")
        if "_" in words:
            bad.append(f"{command} {long[0]}: the hyphenated spelling comes first")
        if "-" in words and f"--{words.replace('-', '_')}" not in long:
            bad.append(f"{command} {long[0]}: no --{words.replace('-', '_')} alias (documented commands use it)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("error, label", [
    ("RecipeError('batch_size', 'must be positive')", "recipe error: batch_size: must be positive"),
    ("RecipeError('--top-k', 'must be at least 1')", "argument error: --top-k: must be at least 1"),
    ("RecipeError('model_dir', 'is a reranker')", "argument error: model_dir: is a reranker"),
    ("ArgumentError('runs', 'needs two')", "argument error: runs: needs two"),
    ("EnvironmentProblem('--faiss', 'pip install faiss-cpu')", "environment error: --faiss: pip install faiss-cpu"),
    ("DataError('bad row', 'a.jsonl', 3)", "data error: a.jsonl, row 3: bad row"),
])
def test_each_error_says_what_kind_of_problem_it_is(error, label):
    from vembed import errors

    assert str(eval(error, vars(errors))) == label


def test_a_missing_package_is_an_environment_error_naming_the_extra(monkeypatch):
    import importlib.util

    from vembed.errors import EnvironmentProblem, require_package

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EnvironmentProblem) as error:
        require_package("bm25s", "model_dir", "bm25", "search")
    assert str(error.value) == ("environment error: model_dir: bm25 needs bm25s, which is not installed: pip install "
                                "'vembed[search]'")
