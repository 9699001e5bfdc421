"""The sentence-transformers export: the exported folder loads offline and embeds exactly as vembed does."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from vembed.api import Embedder
from vembed.errors import RecipeError
from vembed.export import ExportError, export_sentence_transformers

st = pytest.importorskip("sentence_transformers")

TINY = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1, "num_attention_heads": 4}
VISION = {**TINY, "image_size": 32, "patch_size": 8}
# Short and long texts: the long one is truncated at 16 tokens, the short ones are padded in a batch.
TEXTS = ["a star", "a photo of a red square", "the number three written by hand " * 4]


@pytest.fixture(scope="module")
def saved(tiny_tokenizer_dir, tmp_path_factory):
    """`saved(model_type, **recipe)`: the folder of a tiny random-init model (built and saved on each call)."""
    from transformers import AutoTokenizer

    from vembed.components import recipe_from_dict
    from vembed.data.tokenizer import special_token_ids
    from vembed.models import MODELS

    token_ids = special_token_ids(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    text = {**TINY, **token_ids, "max_position_embeddings": 16}
    configs = {
        "text": {"model_type": "bert", **text},
        "clip": {"text_config": text, "vision_config": VISION, "projection_dim": 24},
        "siglip": {"text_config": {**text, "projection_size": 32}, "vision_config": VISION},
    }

    def make(model_type: str, **overrides) -> str:
        raw = {"model_type": model_type, "tokenizer_name": tiny_tokenizer_dir, "model_config": configs[model_type]}
        torch.manual_seed(0)
        adapter = MODELS.get(model_type).from_recipe(recipe_from_dict({**raw, **overrides}))
        path = tmp_path_factory.mktemp(model_type)
        adapter.save(path)
        return str(path)

    return make


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (30 + 7 * i, 44, 3), dtype=np.uint8)) for i in range(3)]


def _export_and_load(model_dir: str, out_dir):
    path = export_sentence_transformers(model_dir, out_dir)
    assert path == out_dir and (out_dir / "modules.json").is_file() and not (out_dir / "vembed.json").exists()
    return st.SentenceTransformer(str(out_dir), device="cpu", local_files_only=True)


def _assert_same(exported, ours: Embedder, **inputs):
    (kind, values), = inputs.items()
    expected = ours.encode(**inputs, normalize=False, batch_size=2)
    got = exported.encode(values, convert_to_tensor=True, batch_size=3)
    torch.testing.assert_close(got.cpu().float(), expected, atol=1e-5, rtol=0, msg=kind)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_text_model_export_matches_vembed(saved, tmp_path, pooling):
    model_dir = saved("text", pooling=pooling)
    exported = _export_and_load(model_dir, tmp_path / "st")
    _assert_same(exported, Embedder.from_pretrained(model_dir, device="cpu"), texts=TEXTS)


def test_unnormalised_text_model_exports_without_normalize(saved, tmp_path):
    model_dir = saved("text", normalize=False)
    exported = _export_and_load(model_dir, tmp_path / "st")
    assert not any("Normalize" in type(module).__name__ for module in exported)
    ours = Embedder.from_pretrained(model_dir, device="cpu")
    assert not torch.allclose(ours.encode(texts=TEXTS, normalize=False).norm(dim=-1), torch.ones(3))
    _assert_same(exported, ours, texts=TEXTS)


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_dual_encoder_export_matches_vembed_for_texts_and_images(saved, tmp_path, model_type):
    model_dir = saved(model_type)
    exported = _export_and_load(model_dir, tmp_path / "st")
    ours = Embedder.from_pretrained(model_dir, device="cpu")
    _assert_same(exported, ours, texts=TEXTS)
    _assert_same(exported, ours, texts=TEXTS[:2])  # SigLIP: short texts are still padded to max_length
    _assert_same(exported, ours, images=_images())


def test_other_model_types_are_refused_with_the_exportable_ones_named(tmp_path):
    (tmp_path / "vembed.json").write_text(json.dumps({"model_type": "composed", "embedding_dim": 8, "settings": {}}))
    with pytest.raises(ExportError, match="'composed' cannot be exported.*clip, siglip, text"):
        export_sentence_transformers(tmp_path, tmp_path / "st")


def test_output_folder_rules(saved, tmp_path):
    model_dir = saved("text")
    with pytest.raises(ExportError, match="must differ"):
        export_sentence_transformers(model_dir, model_dir)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a sentence-transformers folder"):
        export_sentence_transformers(model_dir, tmp_path / "busy")
    out = tmp_path / "st"
    export_sentence_transformers(model_dir, out)
    (out / "stale.txt").write_text("from an older export")
    with pytest.raises(RecipeError, match="st exists; pass --overwrite to replace it"):  # as `vembed mine --out`
        export_sentence_transformers(model_dir, out)
    assert (out / "stale.txt").exists()
    export_sentence_transformers(model_dir, out, overwrite=True)  # a previous export is replaced, not merged into
    assert not (out / "stale.txt").exists() and (out / "modules.json").is_file()


def test_export_cli_refuses_an_existing_export_without_overwrite(saved, tmp_path, capsys):
    from vembed.cli import main

    model_dir, out = saved("text"), tmp_path / "st"
    assert main(["export", model_dir, "--out", str(out)]) == 0
    before = (out / "modules.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["export", model_dir, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"argument error: --out: {out} exists; pass --overwrite to replace it, or choose another --out"]
    assert (out / "modules.json").stat().st_mtime_ns == before
    assert main(["export", model_dir, "--out", str(out), "--overwrite"]) == 0


def test_a_mismatching_export_fails_and_leaves_nothing(saved, tmp_path, monkeypatch):
    import vembed.models.sentence_transformers as modules

    monkeypatch.setattr(modules, "normalize", lambda settings: [])  # drop the Normalize module of a normalised model
    with pytest.raises(ExportError, match="texts embeddings differ from vembed's"):
        export_sentence_transformers(saved("text"), tmp_path / "st")
    assert list(tmp_path.iterdir()) == []


def test_missing_or_old_sentence_transformers_says_what_to_install(saved, tmp_path, monkeypatch):
    model_dir = saved("text")
    monkeypatch.setattr(st, "__version__", "5.1.0")
    with pytest.raises(ExportError, match=r"5.1.0 is too old.*pip install -U 'vembed\[sentence-transformers\]'"):
        export_sentence_transformers(model_dir, tmp_path / "st")
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import now raises ImportError
    with pytest.raises(ExportError, match=r"not installed; pip install vembed\[sentence-transformers\]"):
        export_sentence_transformers(model_dir, tmp_path / "st")
    assert not (tmp_path / "st").exists()
