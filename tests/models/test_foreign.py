"""Models vembed did not save (vembed/models/foreign.py): sentence-transformers and plain transformers folders embed
as sentence-transformers embeds them, and `vembed eval` / `vembed mine` run on them."""

from __future__ import annotations

import json

import pytest
import torch
from corpora import make_corpus_folder
from tiny_models import (
    save_cross_encoder_folders,
    save_sentence_transformers_folder,
    save_transformers_folder,
)

from vembed.cli import main
from vembed.models.foreign import load_embedding_model

st = pytest.importorskip("sentence_transformers")

# Short texts padded in a batch, and a long one truncated at the sentence-transformers model's 8 tokens.
TEXTS = ["a star", "a photo of a red square", "the number three written by hand " * 4, "a blue circle"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("foreign")
    plain = save_transformers_folder(root / "transformers", tiny_tokenizer_dir)
    return {"transformers": plain, "sentence-transformers": save_sentence_transformers_folder(root / "st", plain),
            "corpus": str(make_corpus_folder(root / "corpus")), "root": root}


def _theirs(folder: str) -> torch.Tensor:
    model = st.SentenceTransformer(folder, device="cpu", local_files_only=True)
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=3).cpu().float()


@pytest.mark.parametrize("kind", ["transformers", "sentence-transformers"])
def test_foreign_folder_embeds_as_sentence_transformers_encode(folders, kind):
    from vembed.data.records import Side
    from vembed.models.encoding import encode_sides

    adapter = load_embedding_model(folders[kind])
    ours = encode_sides(adapter, [Side(text=t) for t in TEXTS], batch_size=2)
    torch.testing.assert_close(ours, _theirs(folders[kind]), atol=1e-5, rtol=0)
    if kind == "sentence-transformers":  # cls + Normalize + 8 tokens were read from the folder, not defaulted
        assert adapter.settings.pooling == "cls" and adapter.settings.normalize and adapter.settings.max_length == 8
    else:  # sentence-transformers' own reading of a plain folder: mean pooling, no Normalize
        assert adapter.settings.pooling == "mean" and not adapter.settings.normalize


@pytest.mark.parametrize("kind", ["transformers", "sentence-transformers"])
def test_eval_and_mine_run_on_a_foreign_folder(folders, kind, tmp_path, capsys):
    metrics = tmp_path / "metrics.json"
    assert main(["eval", folders[kind], folders["corpus"], "--output", str(metrics)]) == 0
    assert 0 <= json.loads(metrics.read_text())["corpus/ndcg@10"] <= 1
    out = tmp_path / "negatives.jsonl"
    assert main(["mine", folders[kind], folders["corpus"], "--out", str(out), "--range-min", "0", "--range-max",
                 "10", "--num-negatives", "2", "--max-score-ratio", "none", "--faiss", "no"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(len(row["negative_ids"]) == 2 for row in rows)


@pytest.mark.parametrize("command", ["eval", "mine"])
@pytest.mark.parametrize("model, expected", [
    ("empty", "is not a model folder: it has no vembed.json (vembed), modules.json (sentence-transformers) or "
              "config.json (transformers)"),
    ("nobody/no-such-model", "nobody/no-such-model is neither a local folder nor in the hub cache, and "
                             "HF_HUB_OFFLINE is set"),
])
def test_a_folder_that_is_no_model_is_one_line_and_exit_2(folders, tmp_path, capsys, monkeypatch, command, model,
                                                          expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if model == "empty":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "notes.txt").write_text("not a model")
        model = str(tmp_path / "empty")
    extra = ["--out", str(tmp_path / "negatives.jsonl")] if command == "mine" else []
    assert main([command, model, folders["corpus"], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "negatives.jsonl").exists()


def test_a_sentence_transformers_pipeline_vembed_cannot_reproduce_is_refused_by_name(folders, tmp_path):
    from vembed.errors import RecipeError

    path = save_sentence_transformers_folder(tmp_path / "max", folders["transformers"], pooling="max")
    with pytest.raises(RecipeError, match="pools with 'max'; vembed pools with mean, cls, lasttoken only"):
        load_embedding_model(path)


@pytest.fixture(scope="module")
def cross_encoders(folders, tiny_tokenizer_dir):
    return save_cross_encoder_folders(folders["root"], tiny_tokenizer_dir)


def test_a_reranker_is_recognised_by_what_it_is_whoever_saved_it(folders, cross_encoders, tmp_path):
    from pathlib import Path

    from vembed.models.foreign import reranker_kind

    assert reranker_kind(Path(cross_encoders["transformers"])) == ("a transformers BertForSequenceClassification (a "
                                                                   "cross-encoder reranker or a classifier)")
    assert reranker_kind(Path(cross_encoders["sentence-transformers"])) == "a sentence-transformers CrossEncoder"
    assert reranker_kind(Path(folders["transformers"])) is None
    assert reranker_kind(Path(folders["sentence-transformers"])) is None
    saved = tmp_path / "vembed-reranker"  # vembed's marker names a reranker model_type
    saved.mkdir()
    (saved / "vembed.json").write_text(json.dumps({"model_type": "qwen_vl_reranker"}))
    assert reranker_kind(saved) == "a 'qwen_vl_reranker' reranker"
    (saved / "vembed.json").write_text(json.dumps({"model_type": "text"}))  # vembed's word over a copied config
    (saved / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    assert reranker_kind(saved) is None


@pytest.mark.parametrize("kind", ["transformers", "sentence-transformers"])
@pytest.mark.parametrize("command", ["mine", "eval", "export", "search", "rerank"])
def test_a_cross_encoder_vembed_did_not_save_is_one_line_exit_2_and_nothing_written(folders, cross_encoders,
                                                                                     tmp_path, capsys, command, kind):
    model = cross_encoders[kind]
    out = tmp_path / "out"
    argv = {"mine": ["mine", model, folders["corpus"], "--out", str(out / "negatives.jsonl"), "--faiss", "no"],
            "eval": ["eval", model, folders["corpus"], "--output", str(out / "metrics.json")],
            "export": ["export", model, "--out", str(out / "exported")],
            "search": ["search", model, folders["corpus"], "--out", str(out / "run.trec")],
            "rerank": ["rerank", model, folders["corpus"], "--run", str(tmp_path / "first.trec"), "--out",
                       str(out / "reranked.trec")]}[command]
    (tmp_path / "first.trec").write_text("q1 Q0 d1 1 1.0 first\n")
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"argument error: model_dir: {model} is a ") and (
        "it scores (query, document) pairs and embeds nothing" in lines[0]), lines
    assert not out.exists()  # no mined rows, embedding cache, metrics or export
