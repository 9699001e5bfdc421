"""`vembed demo-vision`: the digit folders it writes, and a short run of it end to end."""

from __future__ import annotations

import pytest


def test_digit_folders_split_every_class_60_20_20(tmp_path):
    from vembed.entrypoints.demo_vision import write_digit_folders

    counts = write_digit_folders(tmp_path)
    assert counts == {"train": 1074, "validation": 359, "test": 364} and sum(counts.values()) == 1797
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [str(d) for d in range(10)]


@pytest.mark.slow
def test_a_short_demo_run_prints_before_and_after_and_writes_the_confusion_matrix(tmp_path, capsys, monkeypatch):
    from vembed.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo-vision", "--config_override", "max_steps=3", "eval_steps=null"]) == 0
    out = capsys.readouterr().out
    assert "validation accuracy" in out and "test accuracy" in out
    assert (tmp_path / "runs" / "demo_vision" / "confusion_matrix.png").is_file()
    assert (tmp_path / "runs" / "demo_vision" / "final" / "heads.safetensors").is_file()


def test_the_i2i_report_has_recall_at_1_and_map_at_r_before_and_after(capsys):
    from vembed.entrypoints.demo_vision import _print_table

    scores = {"recall_at_1": 0.5, "mean_average_precision_at_r": 0.25}
    _print_table({"before": scores, "validation": {"recall_at_1": 0.9, "mean_average_precision_at_r": 0.75},
                  "test": {"recall_at_1": 0.875, "mean_average_precision_at_r": 0.7}}, "runs/x", "i2i")
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["validation", "recall@1", "0.500", "0.900"] in rows
    assert ["validation", "MAP@R", "0.250", "0.750"] in rows
    assert ["test", "recall@1", "0.875"] in rows


@pytest.mark.slow
def test_a_short_i2i_demo_run_reports_retrieval_before_and_after(tmp_path, capsys, monkeypatch):
    pytest.importorskip("pytorch_metric_learning")
    from vembed.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo-vision", "--task", "i2i", "--config_override", "max_steps=2", "eval_steps=null"]) == 0
    out = capsys.readouterr().out
    assert "validation recall@1" in out and "validation MAP@R" in out and "test recall@1" in out
    assert (tmp_path / "runs" / "demo_vision_i2i" / "final" / "heads.safetensors").is_file()  # the projection
