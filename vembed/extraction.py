"""Paired teacher embeddings for blip3o_dit: two vision encoders (teachers) run over every image, their patch tokens
written in shards (`vembed.data.embedding_shards`). `vembed extract` (vembed/entrypoints/extract.py) is the command.

Under `accelerate launch` each process takes shards round-robin (shard i → rank i mod world), so no two processes
ever write one file; shards already complete are skipped, so an interrupted extraction resumes where it stopped.
Images that cannot be read are skipped and counted. Any transformers vision model (or the vision tower of a
CLIP-like model) can be a teacher.

Text teachers, for embedding distillation (loss_type embedding_mse): `extract_teacher_embeddings` embeds the query
text of every training row of a recipe once, so the teacher is never in memory while the student trains.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vembed.data.images import IMAGE_EXTENSIONS
from vembed.errors import DataError, RecipeError
from vembed.files import replace_atomically

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SETTINGS_FILE = "extraction.json"  # what the shards in a folder were made with: a rerun resumes only the same


def check_resumable(out: Path, settings: dict) -> None:
    """Shards already in `out` are kept and skipped, so they must be this extraction's: refused in one line when they
    were made with other settings (other teachers, images, shard size, tokens, dtype) or by something else."""
    from vembed.data.embedding_shards import INDEX_FILE

    if not out.is_dir() or not (any(out.glob("shard-*.safetensors")) or (out / INDEX_FILE).is_file()):
        return
    recorded = None
    for name in (SETTINGS_FILE, INDEX_FILE):  # an index alone: a finished extraction of an earlier vembed
        try:
            recorded = json.loads((out / name).read_text())
            break
        except (OSError, ValueError):
            continue
    if not isinstance(recorded, dict):
        raise RecipeError("--out", f"{out} holds shards without {SETTINGS_FILE}, not written by vembed extract; "
                                   "choose another --out")
    differ = [f"{key} {recorded[key]!r} there, {value!r} now" for key, value in settings.items()
              if key in recorded and recorded[key] != value]
    if differ:
        raise RecipeError("--out", f"{out} holds an extraction with other settings ({'; '.join(differ)}): its "
                                   "shards would be mixed with these; choose another --out")


@dataclass(frozen=True)
class ImageRef:
    """One image: a file, or a member of a tar archive (`archive.tar::member`)."""

    source: str
    path: str
    member: str | None = None

    def load(self):
        from PIL import Image

        from vembed.data.images import load_image

        if self.member is None:
            return load_image(self.path)
        with tarfile.open(self.path) as archive:
            data = archive.extractfile(self.member).read()
        try:
            image = Image.open(io.BytesIO(data))
        except Exception as err:  # noqa: BLE001 - PIL raises many types for bad data
            raise DataError(f"cannot decode image: {type(err).__name__}: {err}", file=self.source) from err
        image.filename = self.source
        return load_image(image)


def list_images(inputs: list[str]) -> list[ImageRef]:
    """Every image under the given directories (recursively) and inside the given .tar files, in a fixed order."""
    refs: list[ImageRef] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
            tars = sorted(p for p in path.rglob("*.tar") if p.is_file())
            refs += [ImageRef(str(p.relative_to(path)), str(p)) for p in files]
            for tar in tars:
                refs += _tar_members(tar)
        elif path.is_file() and path.suffix == ".tar":
            refs += _tar_members(path)
        else:
            raise RecipeError("--images", f"{item!r} is neither a directory nor a .tar file")
    if not refs:
        raise DataError("no images found (looked for " + ", ".join(IMAGE_EXTENSIONS) + " and .tar)",
                        file=", ".join(inputs))
    return refs


def _tar_members(tar: Path) -> list[ImageRef]:
    with tarfile.open(tar) as archive:
        names = sorted(m.name for m in archive.getmembers() if m.isfile() and m.name.lower().endswith(IMAGE_EXTENSIONS))
    return [ImageRef(f"{tar.name}::{name}", str(tar), name) for name in names]


class Teacher:
    """A vision encoder and its image processor; `encode(images)` → (n, tokens, dim) patch tokens (float32).

    `tokens="patch"` drops the tokens before the patch grid (CLS, registers) when the config tells the grid size.
    """

    def __init__(self, name: str, device: torch.device, tokens: str = "patch", trust_remote_code: bool = False):
        from transformers import AutoImageProcessor, AutoModel

        self.name = name
        try:
            self.processor = AutoImageProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
            model = AutoModel.from_pretrained(name, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise RecipeError("--teacher", f"cannot load {name!r}: {str(err).splitlines()[0]}") from None
        # A CLIP/SigLIP-style dual encoder: keep only its vision tower.
        self.model = getattr(model, "vision_model", model).to(device).eval()
        self.device = device
        self.tokens = tokens
        config = getattr(self.model, "config", None)
        image, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
        as_int = (lambda v: v if isinstance(v, int) else v[0]) if image and patch else None
        self.num_patches = (as_int(image) // as_int(patch)) ** 2 if as_int else None

    @torch.no_grad()
    def encode(self, images: list) -> torch.Tensor:
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)
        hidden = self.model(pixel_values=pixels).last_hidden_state.float()
        if self.tokens == "patch" and self.num_patches and hidden.shape[1] > self.num_patches:
            hidden = hidden[:, hidden.shape[1] - self.num_patches :]
        return hidden.cpu()


def extract(
    *,
    teacher_a: str,
    teacher_b: str,
    images: list[str],
    out: str | Path,
    shard_size: int = 1000,
    batch_size: int = 32,
    dtype: str = "float16",
    tokens: str = "patch",
    trust_remote_code: bool = False,
) -> dict:
    """Extract on this process's shards; the main process writes `index.json` once every process is done.

    Returns this process's counts: `{"written": [...], "skipped_finished": [...], "skipped_images": n}`.
    """
    from vembed.data.embedding_shards import shard_name, write_index

    state = _process_state()
    out = Path(out)
    settings = {"teacher_a": teacher_a, "teacher_b": teacher_b, "sources": list(images), "shard_size": shard_size,
                "tokens": tokens, "dtype": dtype}
    check_resumable(out, settings)  # every process, before any waits for another
    refs = list_images(images)
    groups = [refs[i : i + shard_size] for i in range(0, len(refs), shard_size)]
    mine, todo = _claim_shards(out, settings, len(groups), state)
    result = {"written": [], "skipped_finished": [i for i in mine if i not in todo], "skipped_images": 0}
    if todo:
        a = Teacher(teacher_a, state.device, tokens, trust_remote_code)
        b = Teacher(teacher_b, state.device, tokens, trust_remote_code)
        for i in todo:
            result["skipped_images"] += _extract_shard(groups[i], a, b, out / shard_name(i), batch_size,
                                                       DTYPES[dtype], state.process_index)
            result["written"].append(i)
    state.wait_for_everyone()
    if state.is_main_process:
        index = write_index(out, [out / shard_name(i) for i in range(len(groups))],
                            {"teacher_a": teacher_a, "teacher_b": teacher_b, "sources": list(images),
                             "shard_size": shard_size, "tokens": tokens})
        result["index"] = index
    state.wait_for_everyone()
    return result


def _claim_shards(out: Path, settings: dict, num_shards: int, state) -> tuple[list[int], list[int]]:
    """This process's shards (round-robin) and those of them still to write: the main process records the settings
    first (what a rerun is checked against); a complete shard exists under its final name, so a rerun skips it."""
    from vembed.data.embedding_shards import shard_name

    mine = [i for i in range(num_shards) if i % state.num_processes == state.process_index]
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        replace_atomically(out / SETTINGS_FILE, lambda tmp: tmp.write_text(json.dumps(settings, indent=1)))
    state.wait_for_everyone()
    return mine, [i for i in mine if not (out / shard_name(i)).is_file()]


def _process_state():
    """This process's place in the launch. As the training launch does: CPU when there is no GPU or the launcher
    asked for it (PartialState() alone misses the CPU process group that `accelerate launch` with use_cpu prepared,
    and every rank thinks it is 0)."""
    import os

    from accelerate import PartialState

    on_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    return PartialState(cpu=on_cpu)


def extract_teacher_embeddings(
    *,
    teacher: str,
    recipe: str | Path,
    out: str | Path,
    shard_size: int = 10000,
    batch_size: int = 64,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    overrides: list[str] | None = None,
) -> dict:
    """A text teacher's embeddings of the query text of every training record of `recipe` (data.train, read with its
    column mapping, rows kept as training keeps them), for loss_type embedding_mse (vembed/data/teacher_embeddings.py).

    Records go into shards of `shard_size` in their order; shard i is written by process i mod world, complete
    shards are skipped on a rerun; the main process writes `index.json` once every process is done. `teacher`: any
    model folder vembed can load (a vembed save, a sentence-transformers or transformers folder, a cached hub id).
    Returns this process's counts: `{"written": [...], "skipped_finished": [...]}` (and `index` on the main one).
    """
    from vembed.components import load_recipe
    from vembed.data.embedding_shards import read_shard_metadata, shard_name, write_tensors
    from vembed.data.records import Side
    from vembed.data.rows import PairRows
    from vembed.data.sources import load_rows
    from vembed.data.teacher_embeddings import fingerprint, record_keys
    from vembed.data.teacher_embeddings import write_index as write_teacher_index
    from vembed.models.encoding import encode_sides
    from vembed.models.foreign import load_embedding_model, require_embedder

    state = _process_state()
    out = Path(out)
    # A bad teacher name, or a reranker, fails before any data is read
    require_embedder(teacher, "--teacher", instead="the teacher embeds the rows; name an embedding model")
    loaded = load_recipe(recipe, overrides)
    rows, _ = load_rows(loaded.data, "train", num_hard_negatives=0)  # as embedding_mse training reads them
    if not isinstance(rows, PairRows):
        raise RecipeError("data.train", "is a corpus folder; teacher embeddings are extracted for pairs files "
                                        "(JSONL/CSV/Parquet/hf) whose rows they are matched to")
    files, file_ids, numbers, texts = record_keys(rows)
    blank = next((i for i, text in enumerate(texts) if text is None), None)
    if blank is not None:
        raise DataError("has no query text: the teacher embeds each row's query text (data.columns.query)",
                        file=files[file_ids[blank]], row=int(numbers[blank]))
    settings = {"teacher": teacher, "files": files, "shard_size": shard_size, "dtype": dtype}
    check_resumable(out, settings)  # every process, before any waits for another
    groups = [range(i, min(i + shard_size, len(texts))) for i in range(0, len(texts), shard_size)]
    mine, todo = _claim_shards(out, settings, len(groups), state)
    result: dict = {"written": [], "skipped_finished": [i for i in mine if i not in todo]}
    if todo:
        model = load_embedding_model(teacher, trust_remote_code=trust_remote_code, key="--teacher")
        model.to(state.device).eval()
        for i in todo:
            chosen = list(groups[i])
            with torch.no_grad():
                embedding = encode_sides(model, [Side(text=texts[j]) for j in chosen], batch_size=batch_size)
            write_tensors(out / shard_name(i), {
                "embedding": embedding.cpu().to(DTYPES[dtype]),
                "file": torch.as_tensor(file_ids[chosen]), "row": torch.as_tensor(numbers[chosen]),
                "fingerprint": torch.tensor([fingerprint(texts[j]) for j in chosen], dtype=torch.int64),
            }, {"rank": str(state.process_index)})
            result["written"].append(i)
    state.wait_for_everyone()
    if state.is_main_process:
        shards = [{"file": shard_name(i), "count": len(group)} for i, group in enumerate(groups)]
        dim = read_shard_metadata(out / shard_name(0))["shapes"]["embedding"][1] if groups else 0
        result["index"] = write_teacher_index(out, {"teacher": teacher, "dim": dim, "files": files, "dtype": dtype},
                                              shards)
    state.wait_for_everyone()
    return result


def _extract_shard(refs: list[ImageRef], a: Teacher, b: Teacher, path: Path, batch_size: int, dtype: torch.dtype,
                   rank: int) -> int:
    from vembed.data.embedding_shards import write_shard

    eva, clip, sources, skipped = [], [], [], []
    for start in range(0, len(refs), batch_size):
        loaded = []
        for ref in refs[start : start + batch_size]:
            try:
                loaded.append((ref, ref.load()))
            except DataError:
                skipped.append(ref.source)
        if not loaded:
            continue
        pictures = [img for _, img in loaded]
        eva.append(a.encode(pictures).to(dtype))
        clip.append(b.encode(pictures).to(dtype))
        sources += [ref.source for ref, _ in loaded]
    if eva:
        eva_t, clip_t = torch.cat(eva), torch.cat(clip)
    else:  # every image of the shard was unreadable: an empty shard still records what was skipped
        eva_t, clip_t = torch.zeros(0, 0, 0, dtype=dtype), torch.zeros(0, 0, 0, dtype=dtype)
    write_shard(path, eva_t, clip_t, sources, skipped, rank)
    return len(skipped)
