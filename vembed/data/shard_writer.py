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
from vembed.files import replace_atomically

TEXT_FIELD, IMAGE_FIELD = "query", "positive_image"
WRITTEN_FILE = ".vembed-shards.json"  # the names write_shards wrote here: the only files a rerun may replace


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
    ours = _written_before(out_dir, prefix)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in ours:  # shards of an earlier, longer run would join the glob
        (out_dir / old).unlink(missing_ok=True)
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
    replace_atomically(out_dir / WRITTEN_FILE, lambda tmp: tmp.write_text(json.dumps([*sizes, SIZES_FILE])))
    replace_atomically(out_dir / SIZES_FILE, lambda tmp: tmp.write_text(json.dumps(sizes, indent=1)))
    return paths


def _written_before(out_dir: Path, prefix: str) -> list[str]:
    """The files an earlier `write_shards` left in `out_dir` (its manifest), which may be replaced. Shards or a
    sizes.json it did not write would be deleted, overwritten or read with the new shards by the `prefix-*.tar`
    glob: refused in one line, before anything is written."""
    try:
        ours = set(json.loads((out_dir / WRITTEN_FILE).read_text()))
    except (OSError, ValueError):
        ours = set()
    in_the_way = sorted(path.name for path in [*out_dir.glob(f"{prefix}-*.tar"), out_dir / SIZES_FILE]
                        if path.exists() and path.name not in ours)
    if in_the_way:
        shown = ", ".join(in_the_way[:3]) + (f" and {len(in_the_way) - 3} more" if len(in_the_way) > 3 else "")
        raise DataError(f"holds {shown}, not written by vembed; the new shards would replace them or be read with "
                        "them: choose another --out, or move them away", file=str(out_dir))
    return sorted(ours)


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
