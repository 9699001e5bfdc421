"""README.md's commands as a reader types them: every `vembed` command parses, and the ones that need no hub, GPU or
earlier run (generating data, planning from a config, the offline recipes) run as written from a fresh directory."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def readme_commands() -> list[str]:
    """The shell commands of README's bash blocks: continuation lines joined, `a && b` split."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def vembed_argv(command: str) -> list[str] | None:
    """The arguments after `vembed` (also `accelerate launch ... -m vembed ...`), or None for other programs and for
    commands with a `...` placeholder."""
    words = shlex.split(command, comments=True)
    if "..." in words:
        return None
    if words[:1] == ["vembed"]:
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1:][:1] == ["vembed"]:
        return words[words.index("-m") + 2:]
    return None


def test_every_vembed_command_in_the_readme_parses():
    """`vembed train recipe.yaml data.train=...` (overrides without --config_override) stopped with 'unrecognized
    arguments'."""
    from vembed.cli import build_parser

    parsed = []
    for command in readme_commands():
        argv = vembed_argv(command)
        if argv is None:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse: {command}")
        parsed.append(argv[0])
    assert {"train", "plan", "data", "eval", "export", "mine", "extract"} <= set(parsed)


def _offline(command: str) -> bool:
    """What runs here as written: generated data, planning from a config, the offline recipes (dry run)."""
    return (command.startswith("vembed data ") or ("vembed plan" in command and "model_config=" in command)
            or any(recipe in command for recipe in ("configs/clip_webdataset.yaml", "configs/mixed_sources.yaml")))


@pytest.mark.slow
def test_the_readmes_offline_commands_run_as_written(tmp_path):
    """From a fresh directory holding the clone's configs/ and bench/ (as a clone does), with `vembed` the installed
    console script; training recipes are checked and their launch built (--dry_run), not trained."""
    for name in ("configs", "bench", "run.py"):
        (tmp_path / name).symlink_to(REPO / name)
    commands = [command for command in readme_commands() if _offline(command)]
    assert len(commands) == 6, commands  # 3 data sets, the offline plan, 2 recipes
    vembed = f"{shlex.quote(sys.executable)} -m vembed"
    for command in commands:
        line = re.sub(r"^vembed ", f"{vembed} ", command)
        line = re.sub(r"^python ", f"{shlex.quote(sys.executable)} ", line)
        if " train " in line or "run.py" in line:
            line = line.split("#")[0] + " --dry_run"
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        if "vembed plan" in command:
            assert "recommendation: " in result.stdout


def layout_entries() -> dict[str, set[str]]:
    """README's Layout block as {entry: names it mentions}: an entry is a line starting at the margin (`vembed/data/`,
    `vembed/recipe.py`) with its indented continuation lines; names are words, `.py` dropped (`clip`, `sources`)."""
    block = re.search(r"## Layout\n\n```\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S).group(1)
    entries: dict[str, set[str]] = {}
    key = ""
    for line in block.splitlines():
        if line and not line[0].isspace():
            key = line.split()[0]
            entries[key] = set()
        entries[key] |= {word.removesuffix(".py") for word in re.findall(r"[\w.]+", line)}
    return entries


def test_the_layout_names_every_module():
    """Each module of the package is named in its folder's entry (a top-level module anywhere: cli.py sits with the
    entrypoints), so a module moved or added shows up in the one map a newcomer reads."""
    entries = layout_entries()
    top_level = set().union(*entries.values())
    missing = []
    for path in sorted((REPO / "vembed").rglob("*.py")):
        relative = path.relative_to(REPO)
        if path.name == "__init__.py":
            continue
        if len(relative.parts) == 2:
            named = path.stem in top_level
        else:
            folder = "/".join(relative.parts[:-1]) + "/"
            named = path.stem in entries.get(folder, set())
        if not named:
            missing.append(str(relative))
    assert not missing, f"README's Layout does not name: {', '.join(missing)}"


def test_the_readmes_colbert_example_runs_offline(tmp_path, monkeypatch):
    """The late-interaction example builds a tiny ColBERT, loads it and scores (1 query x 2 documents)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    example = next(block for block in blocks if "encode_token_vectors" in block)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(example, namespace)
    assert namespace["queries"].shape == (1, 32, 128) and namespace["scores"].shape == (1, 2)
    assert (tmp_path / "runs" / "colbert_tiny" / "final" / "config_sentence_transformers.json").is_file()  # PyLate's


def test_the_readmes_colqwen_example_runs_offline(tmp_path, monkeypatch):
    """The ColQwen example builds a tiny Qwen3-VL ColQwen, loads it and scores a text query against a page image."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    example = next(block for block in blocks if "encode_token_vectors(images=" in block)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(example, namespace)
    model, pages = namespace["model"], namespace["pages"]
    assert model.model_type == "qwen_vl" and model.multi_vector and pages.shape[2] == 128
    assert int(pages[0].ne(0).any(-1).sum()) > 16  # 16 image tokens (64x64 pixels) and the chat frame
    assert namespace["scores"].shape == (1, 1)
    assert (tmp_path / "runs" / "colqwen_tiny" / "final" / "1_Dense" / "model.safetensors").is_file()
