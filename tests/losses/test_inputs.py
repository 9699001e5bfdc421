"""vembed/losses/inputs.py: what a loss needs of the training rows (a score per pair, teacher score lists, hard
negatives), refused before training with one line naming the file and the row of the first record that lacks it: a
NaN or missing score cell, a score of the wrong shape, or a file with no score column at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_files import write_jsonl, write_parquet

from vembed.errors import DataError

PAIRS = [{"query": f"a{i}", "positive": f"b{i}", "negatives": [f"c{i}"], "score": float(i)} for i in range(4)]


def _check(loss_type: str, *files: Path, **data):
    """`check_loss_inputs` for `loss_type` on data.train = `files`, loaded as training loads them."""
    from vembed.components import loss_class, recipe_from_dict
    from vembed.data.sources import load_rows
    from vembed.losses.inputs import check_loss_inputs

    train = str(files[0]) if len(files) == 1 else [str(file) for file in files]
    recipe = recipe_from_dict({"model_type": "text", "loss_type": loss_type, "data": {"train": train, **data}})
    rows, _ = load_rows(recipe.data, "train")
    check_loss_inputs(loss_class(recipe), recipe, rows)


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _refused(loss_type: str, *files: Path, **data) -> str:
    with pytest.raises(DataError) as found:
        _check(loss_type, *files, **data)
    message = str(found.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("cell", ["nan", "null", "absent_key"])
def test_a_jsonl_score_cell_that_is_nan_or_missing_names_the_file_and_row(tmp_path, cell):
    rows = [dict(row) for row in PAIRS]
    if cell == "absent_key":
        del rows[2]["score"]
    else:
        rows[2]["score"] = float("nan") if cell == "nan" else None
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    message = _refused("cosent", path)
    assert message.startswith(f"data error: {path}, row 3: data.columns.score ('score') has no score")
    assert "loss_type cosent needs one number per pair" in message and "(1 such record)" in message


@pytest.mark.parametrize("cell", ["nan", "null"])
def test_a_parquet_score_cell_that_is_nan_or_null_names_the_file_and_row(tmp_path, cell):
    rows = [dict(row) for row in PAIRS]
    rows[1]["score"] = float("nan") if cell == "nan" else None
    path = write_parquet(tmp_path / "pairs.parquet", rows)
    assert _refused("cosent", path).startswith(f"data error: {path}, row 2: data.columns.score ('score') has no score")


def test_csv_score_cells_that_are_empty_or_nan_name_the_first_data_row_under_the_header(tmp_path):
    path = _csv(tmp_path / "pairs.csv", "query,positive,score\na,b,1\nc,d,2\ne,f,\ng,h,nan\n")
    message = _refused("cosent", path)
    assert message.startswith(f"data error: {path}, row 3: data.columns.score ('score') has no score")
    assert "(2 such records)" in message


def test_a_file_without_the_score_column_is_named(tmp_path):
    scored = write_jsonl(tmp_path / "a.jsonl", PAIRS)
    unscored = write_jsonl(tmp_path / "b.jsonl", [{"query": "q", "positive": "p"}, {"query": "r", "positive": "s"}])
    assert _refused("cosent", scored, unscored) == (
        f"data error: {unscored}: has no column 'score' (data.columns.score); loss_type cosent needs one number per "
        "pair: give the file one, or map yours with data.columns.score=<column>")


def test_a_renamed_score_column_is_looked_for_under_its_name(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", PAIRS)
    message = _refused("cosent", path, columns={"score": "gold"})
    assert message.startswith(f"data error: {path}: has no column 'gold' (data.columns.score)")


def test_a_list_where_one_number_is_needed_names_the_row(tmp_path):
    rows = [dict(row) for row in PAIRS]
    rows[3]["score"] = [1.0, 0.5]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert _refused("cosine_mse", path).startswith(
        f"data error: {path}, row 4: data.columns.score ('score') has a list of teacher scores; loss_type cosine_mse "
        "needs one number per pair")


def test_a_number_where_teacher_score_lists_are_needed_names_the_row(tmp_path):
    rows = [dict(row, score=[1.0, 0.5]) for row in PAIRS]
    rows[1]["score"] = 0.5
    path = write_jsonl(tmp_path / "lists.jsonl", rows)
    message = _refused("distill_kl", path)
    assert message.startswith(f"data error: {path}, row 2: data.columns.score ('score') has one number; "
                              "loss_type distill_kl needs a list of teacher scores")


def test_a_missing_teacher_score_list_names_the_row(tmp_path):
    rows = [dict(row, score=[1.0, 0.5]) for row in PAIRS]
    rows[2]["score"] = None
    path = write_jsonl(tmp_path / "lists.jsonl", rows)
    assert _refused("distill_kl", path).startswith(f"data error: {path}, row 3: data.columns.score ('score') has no "
                                                   "score")


@pytest.mark.parametrize("margins, row, has", [
    ([2], 3, "has one number"),  # 1 margin among 3 lists: the margin is the odd one out
    ([0, 1, 3], 3, "has a list of teacher scores"),  # 3 margins, 1 list (row 3): the list is
    ([1, 2], 2, "has one number"),  # 2 and 2: a tie names the first margin
])
def test_margins_and_lists_mixed_name_the_first_row_of_the_rarer_shape(tmp_path, margins, row, has):
    rows = [dict(row, score=0.5 if i in margins else [1.0, 0.5]) for i, row in enumerate(PAIRS)]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    message = _refused("margin_mse", path)
    assert message.startswith(f"data error: {path}, row {row}: data.columns.score ('score') {has}; ")
    assert f"0 have no score, {len(margins)} a number, {4 - len(margins)} a list" in message


@pytest.mark.parametrize("loss_type, score", [("cosent", 1.0), ("distill_kl", [1.0, 0.5]),
                                              ("margin_mse", 0.5), ("margin_mse", [1.0, 0.5])])
def test_every_record_with_the_score_a_loss_needs_passes(tmp_path, loss_type, score):
    path = write_jsonl(tmp_path / "ok.jsonl", [dict(row, score=score) for row in PAIRS])
    _check(loss_type, path)


@pytest.mark.parametrize("negatives", [0, 1])  # margin_mse needs 1: one short of it, and exactly it
def test_a_loss_that_needs_hard_negatives_refuses_records_without_enough(tmp_path, negatives):
    path = write_jsonl(tmp_path / "n.jsonl", [dict(row, negatives=row["negatives"][:negatives]) for row in PAIRS])
    if negatives:
        _check("margin_mse", path)
        return
    assert _refused("margin_mse", path) == ("data error: loss_type margin_mse needs at least 1 hard negative per "
                                            "pair; the training records keep 0 (data.columns.negatives, "
                                            "data.num_hard_negatives)")


def test_a_loss_without_scores_ignores_a_missing_score_column(tmp_path):
    _check("infonce", write_jsonl(tmp_path / "plain.jsonl", [{"query": "q", "positive": "p"}]))


def test_a_corpus_folder_has_no_score_column_and_says_so(tmp_path):
    from corpora import make_corpus_folder

    folder = make_corpus_folder(tmp_path / "corpus")
    message = _refused("cosent", folder)
    assert message.startswith(f"data error: {folder}: has no score column (data.columns.score); loss_type cosent")


# --- the command line: one line, exit 2, nothing written, as for a score cell holding text --------------------------
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", ["text", "nan"])
def test_train_refuses_a_nan_score_as_it_refuses_a_text_score(tmp_path, tiny_tokenizer_dir, case):
    """A score cell holding text was already one line naming the row, exit 2, no output folder (the load's own
    check); a NaN cell is refused at the same point, in the same way."""
    import os

    from corpora import text_model_keys

    rows = [dict(row) for row in PAIRS]
    rows[2]["score"] = "high" if case == "text" else float("nan")
    train = write_jsonl(tmp_path / "scored.jsonl", rows)
    raw = {**text_model_keys(tiny_tokenizer_dir), "loss_type": "cosent", "data": {"train": str(train)},
           "output_dir": str(tmp_path / "run"), "batch_size": 2, "max_steps": 1, "eval_before_training": False}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "vembed.entrypoints.train", str(recipe)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"data error: {train}, row 3: data.columns.score"), result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recipe.yaml", "scored.jsonl"]  # no run folder
