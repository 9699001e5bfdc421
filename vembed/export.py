"""Export a saved vembed model as a sentence-transformers folder: `SentenceTransformer(out_dir)` then gives the same
embeddings as `vembed.load(model_dir)` (text models: texts; CLIP/SigLIP: texts and images).

sentence-transformers is optional (`pip install vembed[sentence-transformers]`); it is imported only here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vembed.errors import VembedError
from vembed.models.base import read_adapter_file

MIN_SENTENCE_TRANSFORMERS = "6.0"  # the multimodal Transformer module and the module paths used here
VERIFY_ATOL = 1e-5
PROBE_TEXTS = ["a photo of a cat on a sofa", "vembed export check"]

# vembed pooling name -> sentence-transformers Pooling mode (vembed's cls is the first attended token, which is the
# first token under the right padding text encoders use).
_POOLING_MODES = {"cls": "cls", "mean": "mean", "last": "lasttoken"}


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


def _transformer(model_dir: Path, settings: dict[str, Any], **kwargs: Any):
    """sentence-transformers' Transformer module over the HF files vembed saved, with vembed's truncation."""
    from sentence_transformers.base.modules import Transformer

    trust = {"trust_remote_code": True} if settings.get("trust_remote_code") else {}
    return Transformer(
        str(model_dir),
        max_seq_length=settings.get("max_length"),
        model_kwargs=dict(trust),
        processor_kwargs=dict(trust),
        config_kwargs=dict(trust),
        **kwargs,
    )


def _text_modules(model_dir: Path, info: dict[str, Any]) -> list:
    """Transformer -> Pooling (vembed's pooling) [-> Normalize]."""
    from sentence_transformers.sentence_transformer.modules import Pooling

    settings = info["settings"]
    modules = [
        _transformer(model_dir, settings),
        Pooling(info["embedding_dim"], pooling_mode=_POOLING_MODES[settings.get("pooling", "mean")]),
    ]
    return modules + _normalize(settings)


def _dual_encoder_modules(model_dir: Path, info: dict[str, Any]) -> list:
    """Transformer (its CLIP/SigLIP modality config: get_text_features / get_image_features) [-> Normalize].

    Texts are padded as the adapter pads them (SigLIP: to max_length, since it pools at the last position).
    """
    from vembed.models import MODELS

    padding = getattr(MODELS.get(info["model_type"]), "text_padding", "longest")
    processing = {"text": {"padding": "max_length"}} if padding == "max_length" else None
    return [_transformer(model_dir, info["settings"], processing_kwargs=processing)] + _normalize(info["settings"])


def _normalize(settings: dict[str, Any]) -> list:
    from sentence_transformers.base.modules import Normalize

    return [Normalize()] if settings.get("normalize", True) else []


# model_type -> builder of the sentence-transformers modules. Image+text fusion (one embedding for a side with both)
# has no sentence-transformers equivalent; text-only and image-only inputs match.
EXPORTERS: dict[str, Callable[[Path, dict[str, Any]], list]] = {
    "text": _text_modules,
    "clip": _dual_encoder_modules,
    "siglip": _dual_encoder_modules,
}


def export_sentence_transformers(model_dir: str | Path, out_dir: str | Path, *, verify: bool = True) -> Path:
    """Write `model_dir` (a folder saved by vembed) as a sentence-transformers model folder at `out_dir`.

    Supported model types: text, clip, siglip. The folder loads offline with `SentenceTransformer(out_dir)` (add
    `trust_remote_code=True` for models that need it). With `verify`, both models embed a few probe texts (and, for
    image models, a probe image) and the export fails unless they agree within 1e-5. An existing `out_dir` is
    replaced only when it is itself a sentence-transformers folder (a previous export).
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    info = read_adapter_file(model_dir)
    model_type = info["model_type"]
    if model_type not in EXPORTERS:
        raise ExportError(
            f"model_type {model_type!r} cannot be exported to sentence-transformers; exportable model types: "
            f"{', '.join(EXPORTERS)}"
        )
    if out_dir.resolve() == model_dir.resolve():
        raise ExportError(f"the output folder must differ from the model folder {str(model_dir)!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{str(out_dir)!r} is a file; choose a folder for --out")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "modules.json").is_file():
        raise ExportError(f"{str(out_dir)!r} exists and is not a sentence-transformers folder; choose a new folder")
    st = _sentence_transformers()

    # Written beside the destination, then moved into place: a failed export leaves no half-written folder.
    tmp = out_dir.with_name(f".{out_dir.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = st.SentenceTransformer(modules=EXPORTERS[model_type](model_dir, info), device="cpu")
        model.save(str(tmp))
        if verify:
            _verify(model_dir, tmp, info)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _probe_image():
    from PIL import Image

    return Image.linear_gradient("L").resize((96, 64)).convert("RGB")


def _verify(model_dir: Path, st_dir: Path, info: dict[str, Any]) -> None:
    """Reload the written folder and compare its embeddings with vembed's on probe inputs."""
    from vembed.api import Embedder

    model_type = info["model_type"]
    ours = Embedder.from_pretrained(model_dir, device="cpu")
    trust = bool(info["settings"].get("trust_remote_code"))
    st = _sentence_transformers()
    theirs = st.SentenceTransformer(str(st_dir), device="cpu", local_files_only=True, trust_remote_code=trust)
    probes: list[tuple[str, Any]] = [("texts", PROBE_TEXTS)]
    if model_type != "text":
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
                f"{st.__version__} may handle {model_type} models differently"
            )
