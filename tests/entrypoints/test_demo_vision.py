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
