"""Atomic writes (vembed/files.py): a reader sees the old file or the new one, never half of one, and a failed write
leaves nothing behind."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from vembed.files import write_json_atomic


def test_json_is_written_whole_and_replaces_the_old_file(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    write_json_atomic(path, {"b": 1, "a": [1.5, None]})
    assert path.read_text() == json.dumps({"b": 1, "a": [1.5, None]}, indent=2)  # key order kept, indented
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_a_failed_json_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The training copy of this helper (manifests, run.json, metrics.json) left its fixed `.tmp-<name>` behind when
    the disk filled up mid-write."""
    path = tmp_path / "run.json"
    path.write_text("old")
    original = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        original(self, data[: len(data) // 2], *args, **kwargs)  # half of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        write_json_atomic(path, {"identity": {"seed": 0}})
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
    with pytest.raises(TypeError):  # not JSON: nothing is written at all
        write_json_atomic(path, {"x": object()})
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"] and path.read_text() == "old"
