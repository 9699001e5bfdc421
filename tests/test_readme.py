"""The docs as a reader types them: README.md and every guide in docs/guides/. Every `vembed` command parses; every
bash and python block runs as written from a fresh directory (a clone's configs/, bench/ and run.py beside it), in
order, one directory per page, unless an HTML comment `<!-- not run: REASON -->` right above it says why it cannot
(hub weights, a GPU, data of the reader's own, minutes of training)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
# `vembed` is the console script (this interpreter's `-m vembed`) and `python` this interpreter. A training command
# is checked and its launch built (--dry_run) unless it sets max_steps: then it is a short run, trained as written.
PRELUDE = f"""set -euo pipefail
PY={shlex.quote(sys.executable)}
short() {{ case " $* " in *" max_steps="*) return 0;; esac; return 1; }}
vembed() {{ if [ "$1" = train ] && ! short "$@"; then "$PY" -m vembed "$@" --dry_run; else "$PY" -m vembed "$@"; fi; }}
python() {{ if [ "${{1:-}}" = run.py ] && ! short "$@"; then "$PY" "$@" --dry_run; else "$PY" "$@"; fi; }}
"""


@dataclass
class Block:
    page: Path
    line: int
    language: str
    code: str
    not_run: str | None  # the reason given above the block, or None: it runs

    def __str__(self) -> str:
        name = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page.name
        return f"{name}:{self.line} ({self.language})"


def page_blocks(page: Path) -> list[Block]:
    """The bash and python blocks of a page, each with the `not run` reason of the line above it."""
    text = page.read_text()
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if match.group(1) not in ("bash", "python"):
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.fullmatch(before.strip())
        blocks.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2),
                            reason.group(1) if reason else None))
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def shell_commands(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, `a && b` split, here-document bodies left out."""
    commands, heredoc_end = [], None
    for line in code.replace("\\\n", " ").splitlines():
        if heredoc_end is not None:
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        if match := re.search(r"<<-?\s*'?(\w+)'?", line):
            heredoc_end = match.group(1)
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


def test_every_vembed_command_in_the_docs_parses():
    """`vembed train recipe.yaml data.train=...` (overrides without --config_override) stopped with 'unrecognized
    arguments'; a flag renamed in the code and not in a guide fails here."""
    from vembed.cli import build_parser

    parsed = []
    for block in all_blocks():
        if block.language != "bash":
            continue
        for command in shell_commands(block.code):
            argv = vembed_argv(command)
            if argv is None:
                continue
            try:
                build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{block}: command does not parse: {command}")
            parsed.append(argv[0])
    assert {"train", "plan", "data", "eval", "export", "mine", "extract", "search", "rerank", "fuse",
            "predict", "demo-vision"} <= set(parsed)


def test_every_block_that_is_not_run_says_why_in_its_own_words():
    """A `not run` comment names a reason (not a bare marker), and a page without any runnable block would test
    nothing: each page but the reference-like ones has at least one block that runs or one reason to read."""
    for block in all_blocks():
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 3, f"{block}: say why it is not run: {block.not_run!r}"
    assert sum(block.not_run is None for block in page_blocks(REPO / "README.md")) >= 5


def test_headings_and_link_texts_name_no_issue_numbers():
    """History (which issue brought what) lives in CHANGELOG.md, not in the headings or links a reader follows."""
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for heading in re.findall(r"^#+ .*$", text, flags=re.M):
            assert not re.search(r"\bissue \d", heading, flags=re.I), f"{page.name}: {heading}"
        for link_text in re.findall(r"\[([^\]]+)\]\(", text):
            assert not re.search(r"\bissue \d", link_text, flags=re.I), f"{page.name}: [{link_text}]"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_relative_link_reaches_its_file_and_heading():
    """Guides link each other and the code by relative paths: a moved section or file breaks a link here first."""
    broken = []
    for page in [*PAGES, REPO / "CHANGELOG.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# Python blocks a test of their own runs in-process, with assertions on what they built: not run again by the walk.
RUN_BY_THEIR_OWN_TEST = ('encode_token_vectors(["what is late', "encode_token_vectors(images=")


def fresh_clone_dir(tmp_path: Path) -> Path:
    """A directory holding the clone's configs/, bench/ and run.py, as a clone's root does, and nothing else."""
    for name in ("configs", "bench", "run.py"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    if block.language == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-c", PRELUDE + block.code]
    return subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)


def run_page(page: Path, cwd: Path) -> list[Block]:
    """Every block of the page that carries no `not run` reason, in order, in `cwd`."""
    ran = []
    for block in page_blocks(page):
        if block.not_run is not None or any(marker in block.code for marker in RUN_BY_THEIR_OWN_TEST):
            continue
        result = run_block(block, cwd)
        assert result.returncode == 0, f"{block} failed:\n{block.code}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
        ran.append(block)
    return ran


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> tuple[Path, list[Block]]:
    """README's quickstarts, run once from a fresh clone directory: the guides walk on from there (they use the tiny
    models the quickstarts trained, as a reader who started at the README does)."""
    cwd = fresh_clone_dir(tmp_path_factory.mktemp("walk"))
    return cwd, run_page(REPO / "README.md", cwd)


@pytest.mark.slow
def test_the_readmes_quickstarts_run_as_written(walk):
    """From a fresh directory, with `vembed` the installed console script; training recipes are checked and their
    launch built (--dry_run) unless the command sets max_steps (a short run, as written). The walk ends in the Python
    API, on the models it trained."""
    cwd, ran = walk
    assert (cwd / "runs/demo/final/vembed.json").is_file()
    assert (cwd / "runs/demo_vision/final/heads.safetensors").is_file()
    assert (cwd / "predictions.csv").read_text().startswith("image,")
    assert any("vembed.load" in block.code for block in ran)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES[1:], ids=lambda page: page.name)
def test_the_guides_blocks_run_as_written(page, walk):
    """Each guide's blocks, in order, in the README walk's directory (guides write apart from each other)."""
    run_page(page, walk[0])


def test_a_block_that_fails_fails_the_page(tmp_path):
    """The runner itself: a command whose flag does not exist stops the page with that block named."""
    page = tmp_path / "guide.md"
    page.write_text("# A guide\n\n```bash\nvembed data digits --no-such-flag\n```\n")
    (tmp_path / "run").mkdir()
    with pytest.raises(AssertionError, match=r"guide.md:3 \(bash\) failed"):
        run_page(page, tmp_path / "run")


def layout_entries() -> dict[str, set[str]]:
    """The layout guide's module map as {entry: names it mentions}: an entry is a line starting at the margin
    (`vembed/data/`, `vembed/recipe.py`) with its indented continuation lines; names are words, `.py` dropped."""
    text = (REPO / "docs" / "guides" / "layout.md").read_text()
    block = re.search(r"```\n(vembed/.*?)```", text, flags=re.S).group(1)
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
    assert not missing, f"docs/guides/layout.md does not name: {', '.join(missing)}"


def python_block(containing: str) -> str:
    return next(block.code for block in all_blocks() if block.language == "python" and containing in block.code)


def test_the_colbert_example_runs_offline(tmp_path, monkeypatch):
    """The late-interaction example builds a tiny ColBERT, loads it and scores (1 query x 2 documents)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(python_block("encode_token_vectors([\"what is late"), namespace)
    assert namespace["queries"].shape == (1, 32, 128) and namespace["scores"].shape == (1, 2)
    assert (tmp_path / "runs" / "colbert_tiny" / "final" / "config_sentence_transformers.json").is_file()  # PyLate's


def test_the_colqwen_example_runs_offline(tmp_path, monkeypatch):
    """The ColQwen example builds a tiny Qwen3-VL ColQwen, loads it and scores a text query against a page image."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(python_block("encode_token_vectors(images="), namespace)
    model, pages = namespace["model"], namespace["pages"]
    assert model.model_type == "qwen_vl" and model.multi_vector and pages.shape[2] == 128
    assert int(pages[0].ne(0).any(-1).sum()) > 16  # 16 image tokens (64x64 pixels) and the chat frame
    assert namespace["scores"].shape == (1, 1)
    assert (tmp_path / "runs" / "colqwen_tiny" / "final" / "1_Dense" / "model.safetensors").is_file()
