"""`vembed demo`'s promises that do not need the 2-minute training: what its last line lists is what it wrote, and
the `demo` extra installs what the guide's list of outputs (final-st/) needs, and the guide says which rows it prints."""

from __future__ import annotations

import configparser
from pathlib import Path

from vembed.entrypoints.demo import _print_table

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "vision-language.md"  # what the demo does, prints and reached
SUMMARY = {"zero_shot_accuracy": {"before": 0.1, "after": 0.9}, "test_text_to_image_accuracy@1": {"before": 0.1,
                                                                                                    "after": 1.0}}


def test_outputs_line_lists_final_st_only_when_it_was_exported(capsys):
    _print_table({**SUMMARY, "sentence_transformers_export": "runs/demo/final-st"}, "runs/demo")
    exported = capsys.readouterr().out.splitlines()[-1]
    assert exported.startswith("outputs: runs/demo/ (") and "final-st/" in exported
    _print_table(SUMMARY, "runs/demo")
    skipped = capsys.readouterr().out.splitlines()[-1]
    assert "no final-st/: sentence-transformers is not installed" in skipped


def test_demo_extra_installs_sentence_transformers_for_the_export_readme_lists():
    assert "`final-st/`" in GUIDE.read_text()
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    demo = [line.split(">")[0].split("=")[0].strip() for line in config["options.extras_require"]["demo"].splitlines()]
    assert "sentence-transformers" in demo


def test_the_guide_names_each_row_the_demo_prints_and_no_more(capsys):
    """The guide's table had four rows described as printed where `vembed demo` prints two: it must name the printed
    rows by the labels the table uses, and say how many there are."""
    _print_table(SUMMARY, "runs/demo")
    lines = capsys.readouterr().out.splitlines()
    printed = [line[:34].strip() for line in lines if line[34:].strip()[:1].isdigit()]
    assert printed == ["zero-shot digit accuracy", "text→image accuracy@1 (same digit)"]
    text = " ".join(GUIDE.read_text().split())
    assert "prints two before/after rows" in text
    for label in printed:
        assert f"`{label}`" in text
