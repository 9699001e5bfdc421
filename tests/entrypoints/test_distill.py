"""Embedding distillation from the command line: `vembed extract --teacher --recipe` writes the teacher's vectors,
`vembed train` trains on them; a teacher file that lacks rows, is stale, or is of another size than the student is
one line, exit 2, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from text_teachers import distill_recipe, save_text_teacher, write_translations

from vembed.cli import main as vembed


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("distill_cli")
    teacher = save_text_teacher(root / "teacher", tiny_tokenizer_dir)
    train = write_translations(root / "train.jsonl")
    recipe = distill_recipe(tiny_tokenizer_dir, train, root / "teacher_embeddings", root / "run")
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert vembed(["extract", "--teacher", teacher, "--recipe", str(root / "recipe.yaml"), "--out",
                   recipe["teacher_embeddings"], "--shard-size", "6"]) == 0
    return {"root": root, "train": train, "recipe": recipe, "tokenizer": tiny_tokenizer_dir}


def test_extract_reports_the_rows_and_a_rerun_skips_finished_shards(extracted, capsys):
    root = extracted["root"]
    assert vembed(["extract", "--teacher", str(root / "teacher"), "--recipe", str(root / "recipe.yaml"), "--out",
                   extracted["recipe"]["teacher_embeddings"], "--shard-size", "6"]) == 0
    out = capsys.readouterr().out
    assert "16 rows of 1 file(s)" in out and "this process skipped 3 finished shard(s)" in out, out
    index = json.loads((Path(extracted["recipe"]["teacher_embeddings"]) / "index.json").read_text())
    assert index["num_rows"] == 16 and index["dim"] == 32 and [s["count"] for s in index["shards"]] == [6, 6, 4]


def test_extract_takes_either_a_text_teacher_or_the_vision_pair(extracted, capsys, tmp_path):
    assert vembed(["extract", "--teacher", "x", "--out", str(tmp_path / "o")]) == 2
    assert "--recipe: is required" in capsys.readouterr().err
    assert vembed(["extract", "--teacher", "x", "--recipe", "r.yaml", "--images", "d", "--out", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case, expected", [
    ("missing_rows", "row 17: " + "{root}/teacher_embeddings (teacher_embeddings) has no teacher embedding for 1 of "
                                  "the 17 training rows"),
    ("stale", "row 3: the query text of 1 training rows changed since"),
    ("dim_mismatch", "teacher_embeddings: the teacher's embeddings in"),
])
def test_a_teacher_file_that_does_not_fit_the_data_is_one_line_exit_2_and_nothing_written(extracted, tmp_path,
                                                                                          capsys, case, expected):
    recipe = dict(extracted["recipe"], output_dir=str(tmp_path / "run"))
    text = extracted["train"].read_text()
    if case == "missing_rows":  # the data grew after extraction
        text += json.dumps({"en": "one more question", "de": "noch eine frage"}) + "\n"
    if case == "stale":  # a source sentence was edited after extraction
        text = text.replace("question 2 about", "question 2 regarding")
    if case == "dim_mismatch":
        recipe["model_config"] = {**recipe["model_config"], "hidden_size": 16}
    original = extracted["train"].read_text()
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    try:
        extracted["train"].write_text(text)  # the same file (rows are matched by file and row)
        code = vembed(["train", str(path)])
    finally:
        extracted["train"].write_text(original)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert expected.format(root=extracted["root"]) in err[-1], err
    assert not (tmp_path / "run").exists()


def test_a_reranker_as_teacher_is_one_line_exit_2_and_nothing_written(extracted, tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    from tiny_models import save_cross_encoder_folders

    root = extracted["root"]
    teacher = save_cross_encoder_folders(tmp_path, extracted["tokenizer"])["transformers"]
    out = tmp_path / "teacher_embeddings"
    assert vembed(["extract", "--teacher", teacher, "--recipe", str(root / "recipe.yaml"), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"argument error: --teacher: {teacher} is a transformers BertForSequenceClassification (a "
                     "cross-encoder reranker or a classifier): it scores (query, document) pairs and embeds nothing; "
                     "the teacher embeds the rows; name an embedding model"], lines
    assert not out.exists()
