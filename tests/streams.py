"""Shards for the streaming tests: the dummy data set's training split as WebDataset tars or JSONL files, and tars
written sample by sample (corrupt ones included)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path


def dummy_records(dummy_data_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (dummy_data_dir / "train.jsonl").read_text().splitlines() if line.strip()]


def tar_shards(dummy_data_dir: Path, out_dir: Path, shard_size: int = 10) -> str:
    """The dummy training split (68 records) as tar shards with sizes.json; returns their glob."""
    from vembed.data.shard_writer import write_shards

    write_shards(dummy_records(dummy_data_dir), dummy_data_dir, out_dir, shard_size=shard_size)
    return str(out_dir / "train-*.tar")


def jsonl_shards(dummy_data_dir: Path, out_dir: Path, shard_size: int = 10) -> str:
    """The same records as JSONL files (absolute image paths) with sizes.json; returns their glob."""
    records = dummy_records(dummy_data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for number, start in enumerate(range(0, len(records), shard_size)):
        part = [dict(r, positive_image=str(dummy_data_dir / r["positive_image"]))
                for r in records[start:start + shard_size]]
        name = f"train-{number:05d}.jsonl"
        (out_dir / name).write_text("".join(json.dumps(r) + "\n" for r in part))
        sizes[name] = len(part)
    (out_dir / "sizes.json").write_text(json.dumps(sizes))
    return str(out_dir / "train-*.jsonl")


def png_bytes(colour=(200, 30, 30), size: int = 8) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_tar(path: Path, samples: dict[str, dict[str, bytes]]) -> Path:
    """A tar of `{key: {ext: bytes}}`, members in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path
