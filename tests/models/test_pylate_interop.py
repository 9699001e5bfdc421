"""A saved text ColBERT is a PyLate folder (`vembed/models/pylate_folder.py`): PyLate's `ColBERT(path)` and
sentence-transformers' `MultiVectorEncoder(path)` load it and give vembed's token vectors and MaxSim scores. Two tiny
random-init BERTs: the default settings, and other prefixes with the skip-list off (what a folder must say for
readers whose defaults differ)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from models.conftest import NO_DROPOUT, SMALL

import vembed
from vembed.models.token_vectors import token_mask

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from pylate_runner import pylate_available, run_pylate  # noqa: E402

QUERIES = ["a red square", "blue", "a photo of a small yellow star on a white page, two lines"]  # the last: truncated
DOCUMENTS = ["a red, white.", "a star", "the number three written by hand; two black lines crossing! " * 2]
VARIANTS = {
    "defaults": {},
    "other_prefixes_no_skiplist": {"query_prefix": "", "document_prefix": "<doc> ", "skip_punctuation": False},
}


@pytest.fixture(scope="module")
def colbert_dirs(mask_tokenizer_dir, token_ids, tmp_path_factory):
    """{variant: saved folder} of tiny ColBERTs (query_length 10, max_length 20)."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    config = {"model_type": "bert", **SMALL, **token_ids, "vocab_size": 301, "max_position_embeddings": 24,
              **NO_DROPOUT}
    folders = {}
    for name, changes in VARIANTS.items():
        raw = {"model_type": "text", "tokenizer_name": mask_tokenizer_dir, "model_config": config,
               "embedding": "multi_vector", "multi_vector_dim": 16, "query_length": 10, "max_length": 20,
               "loss_type": "late_interaction", **changes}
        torch.manual_seed(0)
        folders[name] = tmp_path_factory.mktemp(name)
        MODELS.get("text").from_recipe(recipe_from_dict(raw)).save(folders[name])
    return folders


def _vembed_vectors(path):
    """vembed's query vectors `(n, 10, d)` and each document's kept token vectors `(tokens, d)`, and the scores."""
    model = vembed.load(str(path), device="cpu")
    queries, documents = (model.encode_token_vectors(QUERIES, role="query"),
                          model.encode_token_vectors(DOCUMENTS, role="document"))
    kept = token_mask(documents)
    return queries, [documents[i][kept[i]] for i in range(len(DOCUMENTS))], model.score(queries, documents)


def _assert_same(theirs_queries, theirs_documents, theirs_scores, path):
    queries, documents, scores = _vembed_vectors(path)
    torch.testing.assert_close(torch.stack([torch.as_tensor(q) for q in theirs_queries]), queries, atol=1e-5, rtol=0)
    for ours, theirs in zip(documents, theirs_documents):
        torch.testing.assert_close(torch.as_tensor(theirs), ours, atol=1e-5, rtol=0)  # same tokens skipped
    torch.testing.assert_close(theirs_scores, scores, atol=1e-5, rtol=0)


def test_the_folder_holds_pylates_modules_and_vembeds_colbert_settings(colbert_dirs, mask_tokenizer_dir):
    from transformers import AutoTokenizer

    from vembed.models.text import punctuation_tokens

    folder = colbert_dirs["defaults"]
    modules = json.loads((folder / "modules.json").read_text())
    assert [(m["path"], m["type"]) for m in modules] == [("", "sentence_transformers.models.Transformer"),
                                                        ("1_Dense", "pylate.models.Dense.Dense")]
    dense = json.loads((folder / "1_Dense" / "config.json").read_text())
    assert (dense["in_features"], dense["out_features"], dense["bias"]) == (32, 16, False)
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    assert {key: config[key] for key in ("model_type", "similarity_fn_name", "query_prefix", "document_prefix",
                                         "query_length", "document_length", "do_query_expansion",
                                         "attend_to_expansion_tokens")} == {
        "model_type": "ColBERT", "similarity_fn_name": "MaxSim", "query_prefix": "[Q] ", "document_prefix": "[D] ",
        "query_length": 10, "document_length": 20, "do_query_expansion": True, "attend_to_expansion_tokens": True}
    assert config["skiplist_words"] == punctuation_tokens(AutoTokenizer.from_pretrained(mask_tokenizer_dir))
    assert json.loads((colbert_dirs["other_prefixes_no_skiplist"] / "config_sentence_transformers.json").read_text())[
        "skiplist_words"] == []


def test_skiplist_leaves_out_punctuation_the_vocabulary_lacks():
    """PyLate maps such a character to [UNK] and would skip every [UNK] of a document; vembed keeps them."""
    from transformers import BertTokenizerFast

    from vembed.models.text import punctuation_tokens

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", ",", "."])}
    assert punctuation_tokens(BertTokenizerFast(vocab=vocab)) == [",", "."]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sentence_transformers_multi_vector_encoder_gives_vembeds_vectors(colbert_dirs, variant):
    """sentence-transformers >= 6 reads PyLate folders itself (MultiVectorEncoder): a second reader of the format."""
    st = pytest.importorskip("sentence_transformers")
    if not hasattr(st, "MultiVectorEncoder"):
        pytest.skip(f"sentence-transformers {st.__version__} has no MultiVectorEncoder")
    from vembed.models.maxsim import maxsim

    model = st.MultiVectorEncoder(str(colbert_dirs[variant]), device="cpu")
    queries = [torch.as_tensor(q) for q in model.encode_query(QUERIES)]
    documents = [torch.as_tensor(d) for d in model.encode_document(DOCUMENTS)]
    scores = torch.cat([maxsim(torch.stack(queries), d[None]) for d in documents], dim=1)  # unpadded documents
    _assert_same(queries, documents, scores, colbert_dirs[variant])


@pytest.mark.slow  # a child process on PyLate's stack
@pytest.mark.skipif(not pylate_available(), reason="PyLate's stack is not installed (bash scripts/setup.sh dev)")
def test_pylate_loads_the_folder_and_gives_vembeds_token_vectors_and_scores(colbert_dirs, tmp_path):
    """Also: the model card's PyLate example runs and scores as vembed does."""
    from vembed.model_card import EXAMPLE_TEXTS, code_blocks, folder_card, render_card

    outs = {name: tmp_path / f"{name}.pt" for name in colbert_dirs}
    folder = colbert_dirs["defaults"]
    card = render_card(folder_card(folder), load_path=str(folder))
    example = next(block for block in code_blocks(card) if "pylate" in block)
    run_pylate({"encode": {"models": [[str(colbert_dirs[name]), str(outs[name])] for name in colbert_dirs],
                           "queries": QUERIES, "documents": DOCUMENTS},
                "snippet": {"code": example, "out": str(tmp_path / "card.pt")}}, tmp_path / "job", timeout=300)
    for name, out in outs.items():
        theirs = torch.load(out)
        assert len(theirs["queries"][0]) == 10 and theirs["pylate"]  # expanded to query_length
        _assert_same(theirs["queries"], theirs["documents"], theirs["scores"], colbert_dirs[name])
    model = vembed.load(str(folder), device="cpu")
    expected = model.score(model.encode_token_vectors(EXAMPLE_TEXTS[:1], role="query"),
                           model.encode_token_vectors(EXAMPLE_TEXTS, role="document"))
    torch.testing.assert_close(torch.load(tmp_path / "card.pt").float(), expected, atol=1e-5, rtol=0)
