"""Export a saved vembed model as a sentence-transformers folder: `SentenceTransformer(out_dir)` then gives the same
embeddings as `vembed.load(model_dir)` (text models: texts; CLIP/SigLIP: texts and images). Each adapter describes
itself to sentence-transformers (`EmbeddingAdapter.sentence_transformers_modules`); this module checks versions,
writes the folder atomically and verifies it.

sentence-transformers is optional (`pip install vembed[sentence-transformers]`); it is imported only here and in
`vembed/models/sentence_transformers.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from vembed.errors import VembedError
from vembed.files import check_replaceable
from vembed.model_card import folder_card, write_card
from vembed.models import MODELS, EmbeddingAdapter
from vembed.models.base import read_adapter_file

MIN_SENTENCE_TRANSFORMERS = "6.0"  # the multimodal Transformer module and the module paths used here
VERIFY_ATOL = 1e-5
PROBE_TEXTS = ["a photo of a cat on a sofa", "vembed export check"]


class ExportError(VembedError):
    """The model cannot be exported (unsupported model type, missing package, bad output folder, mismatch)."""

    kind = "export error"


def _sentence_transformers():
    from packaging.version import Version

    try:
        import sentence_transformers
    except ImportError:
        raise ExportError("sentence-transformers is not installed; pip install vembed[sentence-transformers]") from None
    if Version(sentence_transformers.__version__) < Version(MIN_SENTENCE_TRANSFORMERS):
        raise ExportError(
            f"sentence-transformers {sentence_transformers.__version__} is too old for export (need >= "
            f"{MIN_SENTENCE_TRANSFORMERS}); pip install -U 'vembed[sentence-transformers]'"
        )
    return sentence_transformers


def export_sentence_transformers(
    model_dir: str | Path, out_dir: str | Path, *, verify: bool = True, trust_remote_code: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write `model_dir` (a folder saved by vembed) as a sentence-transformers model folder at `out_dir`.

    Supported model types: those whose adapter describes itself to sentence-transformers (text, clip, siglip). The
    folder loads offline with `SentenceTransformer(out_dir)` (add `trust_remote_code=True` for models that need it;
    `trust_remote_code` here lets the model folder's own code run while exporting). With `verify`, both models embed
    a few probe texts (and, for image models, a probe image) and the export fails unless they agree within 1e-5. An
    existing `out_dir` is replaced only with `overwrite` (`--overwrite`, the rule of `vembed.files.check_replaceable`)
    and only when it is itself a sentence-transformers folder (a previous export).

    The export gets its own model card (README.md, `vembed/model_card.py`), rendered from the source folder's
    `card.json` (what its training run recorded; a folder saved outside a run gets a card of what its `vembed.json`
    says), with the same plots and the sentence-transformers and MTEB snippets pointing at `out_dir`.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    info = read_adapter_file(model_dir)
    model_type = info["model_type"]
    adapter = MODELS.get(model_type) if model_type in MODELS else None
    if adapter is None or not adapter.has_sentence_transformers_equivalent():
        names = ", ".join(name for name in MODELS.names() if MODELS.get(name).has_sentence_transformers_equivalent())
        raise ExportError(
            f"model_type {model_type!r} cannot be exported to sentence-transformers; exportable model types: {names}"
        )
    if info.get("settings", {}).get("embedding") == "multi_vector":
        raise ExportError(f"{str(model_dir)!r} is a multi_vector (ColBERT) model: it needs no export, the folder "
                          "itself loads in PyLate (pylate.models.ColBERT(path)) and in sentence-transformers >= 6 "
                          "(MultiVectorEncoder(path)); with vembed: vembed.load(path).encode_token_vectors")
    if info.get("settings", {}).get("embedding") == "sparse":
        raise ExportError(f"{str(model_dir)!r} is a sparse (SPLADE) model: it needs no export, the folder itself "
                          "loads in sentence-transformers (SparseEncoder(path)); with vembed: vembed.load(path).encode")
    if out_dir.resolve() == model_dir.resolve():
        raise ExportError(f"the output folder must differ from the model folder {str(model_dir)!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{str(out_dir)!r} is a file; choose a folder for --out")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "modules.json").is_file():
        raise ExportError(f"{str(out_dir)!r} exists and is not a sentence-transformers folder; choose a new folder")
    check_replaceable(out_dir, overwrite)
    st = _sentence_transformers()

    # Written beside the destination, then moved into place: a failed export leaves no half-written folder.
    tmp = out_dir.with_name(f".{out_dir.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        modules = adapter.sentence_transformers_modules(model_dir, info, trust_remote_code)
        model = st.SentenceTransformer(modules=modules, device="cpu")
        model.save(str(tmp), create_model_card=False)  # vembed's card below, from what the run recorded
        if verify:
            _verify(model_dir, tmp, adapter, trust_remote_code)
        write_card(tmp, folder_card(model_dir), plots_from=model_dir, flavour="sentence-transformers",
                   load_path=str(out_dir), source_path=str(model_dir))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _probe_image():
    from PIL import Image

    return Image.linear_gradient("L").resize((96, 64)).convert("RGB")


def _verify(model_dir: Path, st_dir: Path, adapter: type[EmbeddingAdapter], trust_remote_code: bool) -> None:
    """Reload the written folder and compare its embeddings with vembed's on probe inputs."""
    from vembed.api import Embedder

    ours = Embedder.from_pretrained(model_dir, device="cpu", trust_remote_code=trust_remote_code)
    st = _sentence_transformers()
    theirs = st.SentenceTransformer(str(st_dir), device="cpu", local_files_only=True,
                                    trust_remote_code=trust_remote_code)
    probes: list[tuple[str, Any]] = [("texts", PROBE_TEXTS)]
    if "image" in adapter.modalities:
        probes.append(("images", [_probe_image()]))
    for kind, inputs in probes:
        # normalize=False: compare what each model outputs, so a missing or extra Normalize module shows up.
        expected = ours.encode(**{kind: inputs}, normalize=False)
        got = theirs.encode(inputs, convert_to_tensor=True).float().cpu()
        error = (got - expected).abs().max().item() if got.shape == expected.shape else float("inf")
        if not error <= VERIFY_ATOL:
            raise ExportError(
                f"the exported model's {kind} embeddings differ from vembed's (max abs difference {error:.2e}, "
                f"shape {tuple(got.shape)} vs {tuple(expected.shape)}); the installed sentence-transformers "
                f"{st.__version__} may handle {adapter.model_type} models differently"
            )
