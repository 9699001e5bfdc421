"""Write a vembed JSONL split as WebDataset tar shards, the layout open_clip and LAION-style tools write: per sample
`{key}.png` (the positive image), `{key}.txt` (the query text) and `{key}.json` (every other field), plus the
`sizes.json` index. For the streaming example and tests; the standard library's tarfile suffices to write (reading,
with its grouping and error handling, is webdataset's job).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

from vembed.data.streaming import SIZES_FILE
from vembed.errors import DataError

TEXT_FIELD, IMAGE_FIELD = "query", "positive_image"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: the same records give the same bytes
    tar.addfile(info, io.BytesIO(data))


def sample_members(key: str, record: dict[str, Any], image_base: str | os.PathLike) -> dict[str, bytes]:
    """The tar members of one record: `{key}.{image ext}`, `{key}.txt`, `{key}.json`."""
    members: dict[str, bytes] = {}
    image = record.get(IMAGE_FIELD)
    if image:
        path = Path(image_base, image)
        members[f"{key}{path.suffix.lower()}"] = path.read_bytes()
    if record.get(TEXT_FIELD) is not None:
        members[f"{key}.txt"] = str(record[TEXT_FIELD]).encode("utf-8")
    rest = {name: value for name, value in record.items() if name not in (TEXT_FIELD, IMAGE_FIELD)}
    if rest:
        members[f"{key}.json"] = json.dumps(rest).encode("utf-8")
    return members


def write_shards(records: list[dict[str, Any]], image_base: str | os.PathLike, out_dir: str | os.PathLike, *,
                 prefix: str = "train", shard_size: int = 128) -> list[str]:
    """`records` (JSONL rows with `query` and `positive_image`) as `{prefix}-00000.tar`, ... of `shard_size` samples,
    and their sizes in `out_dir/sizes.json`. Returns the shard paths."""
    if shard_size <= 0:
        raise DataError(f"shard size must be positive, got {shard_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{prefix}-*.tar"):  # shards of an earlier, longer run would join the glob
        old.unlink()
    sizes: dict[str, int] = {}
    paths = []
    for number, start in enumerate(range(0, len(records), shard_size)):
        name = f"{prefix}-{number:05d}.tar"
        part = records[start:start + shard_size]
        tmp = out_dir / f".{name}.tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index, record in enumerate(part, start=start):
                for member, data in sample_members(f"{index:06d}", record, image_base).items():
                    _add(tar, member, data)
        tmp.replace(out_dir / name)
        sizes[name] = len(part)
        paths.append(str(out_dir / name))
    (out_dir / SIZES_FILE).write_text(json.dumps(sizes, indent=1))
    return paths


def write_webdataset(out_dir: str | os.PathLike, source: str = "digits", *, num_samples: int = 512,
                     image_size: int = 32, seed: int = 0, shard_size: int = 128) -> dict[str, Any]:
    """An offline WebDataset: the digits (or dummy shapes) data set made in `out_dir/source` (validation and test
    stay JSONL: evaluation reads them whole), its training split as tar shards in `out_dir/shards`."""
    from vembed.data import synthetic

    out_dir = Path(out_dir)
    if source == "digits":
        summary = synthetic.make_digits_dataset(out_dir / "source", image_size=image_size, seed=seed)
    else:
        summary = synthetic.make_dummy_dataset(out_dir / "source", num_samples, seed=seed, image_size=image_size)
    lines = Path(summary["files"]["train"]).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    shards = write_shards(records, summary["image_root"], out_dir / "shards", shard_size=shard_size)
    return {"shards": len(shards), "samples": len(records), "train": str(out_dir / "shards" / "train-*.tar"),
            "validation": summary["files"]["validation"], "tokenizer": summary["tokenizer"]}
