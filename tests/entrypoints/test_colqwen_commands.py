"""A saved ColQwen model (qwen_vl, `embedding: multi_vector`) through the corpus commands: `vembed eval` and `vembed
mine` search page-screenshot documents by MaxSim (vembed/retrieval/maxsim_search.py); and an adapter that gives no
token vectors, asked for them, stops in one line with exit 2."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import yaml
from tiny_models import QWEN_BACKBONES, QWEN_PIXELS, TINY_CLIP_CONFIG

from vembed.cli import main

QUERIES = ["a page about red squares", "the yellow star page", "two black lines", "an empty white page"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random-init ColQwen saved by vembed, and a corpus folder of eight page images (two per query judged:
    its own page 2, the next page 1) with text queries."""
    import torch
    from PIL import Image

    from vembed.components import recipe_from_dict
    from vembed.data.corpus import write_corpus_folder
    from vembed.data.tokenizer import train_qwen_tokenizer
    from vembed.models import MODELS

    root = tmp_path_factory.mktemp("colqwen")
    train_qwen_tokenizer(QUERIES * 8 + ["Represent the user's input."], root / "tokenizer", vocab_size=300)
    recipe = recipe_from_dict({
        "model_type": "qwen_vl", "model_config": {"model_type": "qwen3_vl", **copy.deepcopy(QWEN_BACKBONES["qwen3_vl"])},
        **QWEN_PIXELS, "tokenizer_name": str(root / "tokenizer"), "embedding": "multi_vector", "multi_vector_dim": 16,
        "loss_type": "late_interaction"})
    torch.manual_seed(0)
    MODELS.get("qwen_vl").from_recipe(recipe).save(root / "model")
    corpus = root / "corpus"
    (corpus / "pages").mkdir(parents=True)
    for i in range(8):
        pixels = np.random.default_rng(i).integers(0, 256, size=(16 + 8 * (i % 3), 24, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(corpus / "pages" / f"p{i}.png")
    judged = {f"q{i}": {f"p{2 * i}": 2, f"p{2 * i + 1}": 1} for i in range(len(QUERIES))}
    write_corpus_folder(corpus, {f"p{i}": {"image": f"pages/p{i}.png"} for i in range(8)},
                        {f"q{i}": {"text": text} for i, text in enumerate(QUERIES)},
                        {"train": judged, "test": judged})
    return root


def test_eval_and_mine_search_page_images_by_maxsim(saved, tmp_path, capsys):
    metrics = tmp_path / "metrics.json"
    assert main(["eval", str(saved / "model"), str(saved / "corpus"), "--output", str(metrics)]) == 0
    found = json.loads(metrics.read_text())
    assert found["num_documents"] == 8 and 0 < found["corpus/ndcg@10"] <= 1
    out = tmp_path / "negatives.jsonl"
    assert main(["mine", str(saved / "model"), str(saved / "corpus"), "--out", str(out), "--range-min", "0",
                 "--range-max", "8", "--max-score-ratio", "none", "--num-negatives", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all(len(row["negative_images"]) == 2 for row in rows)
    assert all(row["positive_image"].endswith(".png") and "positive" not in row for row in rows)
    assert all(row["positive_score"] > 1 for row in rows)  # a MaxSim sum over the query's tokens, not a cosine
    assert "search: exact (torch, MaxSim)" in capsys.readouterr().out


def test_an_adapter_without_token_vectors_asked_for_them_stops_in_one_line(tmp_path, tiny_tokenizer_dir, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model_type": "clip", "model_config": TINY_CLIP_CONFIG, "tokenizer_name": tiny_tokenizer_dir,
        "embedding": "multi_vector", "loss_type": "late_interaction", "data": {"train": str(tmp_path / "x.jsonl")},
        "output_dir": str(tmp_path / "run")}))
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert "embedding" in last and "qwen_vl" in last and "text" in last and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
