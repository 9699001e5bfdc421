"""`embedding: sparse` on the text adapter (vembed/models/splade.py): SPLADE's vocabulary-sized vectors from a tiny
random-init BERT's masked-LM head, equal to sentence-transformers' SparseEncoder on the folder vembed saves; pruning
at inference only; and the recipes refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from models.conftest import NO_DROPOUT, SMALL

import vembed
from vembed.components import recipe_from_dict
from vembed.data.records import Side
from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.splade import keep_top_k, splade_pool

TEXTS = ["a photo of a red square", "two", "the number three written by hand; two black lines crossing on white"]


@pytest.fixture(scope="module")
def sparse_recipe(tiny_tokenizer_dir, token_ids):
    """`sparse_recipe(**changes)`: a raw recipe of a tiny random-init BERT with its MLM head, embedding: sparse."""
    config = {"model_type": "bert", **SMALL, **token_ids, "max_position_embeddings": 24, **NO_DROPOUT}

    def make(**changes):
        return {"model_type": "text", "tokenizer_name": tiny_tokenizer_dir, "model_config": config,
                "embedding": "sparse", **changes}

    return make


def _adapter(raw: dict, seed: int = 0):
    torch.manual_seed(seed)
    return MODELS.get("text").from_recipe(recipe_from_dict(raw)).eval()


def _encode(adapter, texts=TEXTS):
    with torch.no_grad():
        return adapter.encode(adapter.preprocess([Side(text=t) for t in texts]))


def test_splade_pooling_is_log1p_relu_of_the_attended_tokens_max_or_sum():
    logits = torch.tensor([[[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [9.0, 9.0, 9.0]],
                           [[-1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the 9s are padding
    log1p = torch.log1p
    assert torch.equal(splade_pool(logits, mask, "max"), torch.stack([
        torch.stack([log1p(torch.tensor(3.0)), torch.tensor(0.0), log1p(torch.tensor(0.5))]),
        torch.stack([torch.tensor(0.0), log1p(torch.tensor(2.0)), torch.tensor(0.0)])]))
    torch.testing.assert_close(splade_pool(logits, mask, "sum")[0], torch.stack([
        log1p(torch.tensor(1.0)) + log1p(torch.tensor(3.0)), torch.tensor(0.0), log1p(torch.tensor(0.5))]))


def test_keep_top_k_keeps_each_rows_largest_weights():
    weights = torch.tensor([[0.1, 0.0, 3.0, 2.0], [5.0, 4.0, 0.0, 0.2]])
    assert torch.equal(keep_top_k(weights, 2), torch.tensor([[0.0, 0.0, 3.0, 2.0], [5.0, 4.0, 0.0, 0.0]]))
    assert torch.equal(keep_top_k(weights, 4), weights)


@pytest.mark.parametrize("changes", [{}, {"sparse_pooling": "sum", "max_length": 6}], ids=["max", "sum_truncated"])
def test_a_saved_sparse_model_is_a_sentence_transformers_sparse_encoder_with_equal_vectors(sparse_recipe, changes,
                                                                                           tmp_path):
    st = pytest.importorskip("sentence_transformers")
    adapter = _adapter(sparse_recipe(**changes))
    assert type(adapter.model).__name__ == "BertForMaskedLM"
    assert adapter.embedding_dim == adapter.model.config.vocab_size and adapter.embedding_kind == "sparse"
    vectors = _encode(adapter)
    assert vectors.shape == (3, adapter.embedding_dim) and vectors.dtype == torch.float32
    assert (vectors >= 0).all() and (vectors > 0).any()
    assert not torch.allclose(vectors.norm(dim=-1), torch.ones(3))  # not L2-normalised
    adapter.save(tmp_path)
    theirs = st.SparseEncoder(str(tmp_path), device="cpu")
    assert theirs.similarity_fn_name == "dot"
    their_vectors = theirs.encode(TEXTS, convert_to_tensor=True).to_dense()
    torch.testing.assert_close(their_vectors, vectors, atol=1e-5, rtol=0)
    # vembed loads it back too: the same vectors, not normalised, scored by dot product
    model = vembed.load(str(tmp_path), device="cpu")
    assert model.sparse and json.loads((tmp_path / "vembed.json").read_text())["settings"]["normalize"] is False
    torch.testing.assert_close(model.encode(TEXTS), vectors, atol=1e-6, rtol=0)
    found = model.search(TEXTS[:1], TEXTS, top_k=3)[0]
    dots = vectors[0] @ vectors.T
    assert [hit["corpus_id"] for hit in found] == dots.argsort(descending=True).tolist()
    assert found[0]["score"] == pytest.approx(dots.max().item(), rel=1e-5)


def test_sparse_top_k_prunes_at_inference_only(sparse_recipe):
    adapter = _adapter(sparse_recipe(sparse_top_k=5))
    full = _adapter(sparse_recipe())
    pruned = _encode(adapter)
    assert ((pruned > 0).sum(dim=1) == 5).all()
    torch.testing.assert_close(pruned, keep_top_k(_encode(full), 5), atol=0, rtol=0)
    adapter.train()
    trained = adapter.encode(adapter.preprocess([Side(text=t) for t in TEXTS]))
    assert ((trained > 0).sum(dim=1) > 5).all()  # no pruning in training: every weight keeps its gradient


def test_embedding_dim_for_the_recipe_is_the_vocabulary(sparse_recipe):
    recipe = recipe_from_dict(sparse_recipe())
    assert MODELS.get("text").embedding_dim_for(recipe) == _adapter(sparse_recipe()).embedding_dim


def _refusal(raw: dict) -> RecipeError:
    """The one-line refusal of `raw`: by the schema, the task's checks, or (the last resort) building the model."""
    from vembed.tasks.contrastive import ContrastiveTask

    with pytest.raises(RecipeError) as err:
        ContrastiveTask.check_recipe(recipe_from_dict(raw), for_training=False)
        MODELS.get("text").from_recipe(recipe_from_dict(raw))
    return err.value


def test_a_model_without_a_masked_lm_head_is_refused_before_any_weight_is_read(sparse_recipe, tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 300}
    err = _refusal(sparse_recipe(model_config=gpt2))
    assert err.key == "model_config" and "masked-LM head" in err.message and "gpt2" in err.message
    # A checkpoint saved without its head (a plain BertModel: what an embedder's folder holds) would start it random.
    from transformers import AutoModel

    config = {k: v for k, v in sparse_recipe()["model_config"].items() if k != "model_type"}
    from transformers import BertConfig

    AutoModel.from_config(BertConfig(**config)).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # reading them would fail otherwise
    raw = {**sparse_recipe(), "model_name": str(tmp_path)}
    raw.pop("model_config")
    err = _refusal(raw)
    assert err.key == "model_name" and "BertModel" in err.message and "embedding: single" in err.message


@pytest.mark.parametrize("changes, key", [
    ({"normalize": True}, "normalize"),
    ({"pooling": "cls"}, "pooling"),
    ({"embedding": "single", "sparse_pooling": "sum"}, "sparse_pooling"),
    ({"embedding": "single", "sparse_top_k": 8}, "sparse_top_k"),
    ({"sparse_top_k": 0}, "sparse_top_k"),
    ({"loss_type": "late_interaction"}, "loss_type"),
    ({"mrl_dims": [64, 32]}, "mrl_dims"),
    ({"embedding": "single", "flops_document_weight": 1e-3}, "flops_document_weight"),
    ({"flops_query_weight": -1.0}, "flops_query_weight"),
    ({"data": {"train": "x.jsonl", "validation": "x.jsonl"}}, "data.validation"),
])
def test_recipes_that_cannot_train_sparse_vectors_are_refused_naming_the_key(sparse_recipe, changes, key, tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"query": "q", "positive": "p"}))
    data = changes.pop("data", {"train": str(tmp_path / "x.jsonl")})
    raw = sparse_recipe(**{**changes, "data": {name: str(tmp_path / path) for name, path in data.items()}})
    err = _refusal(raw)
    assert err.key == key, err


@pytest.mark.parametrize("model_type", ["qwen_vl", "clip"])
def test_sparse_is_refused_on_other_adapters(model_type, recipe_for):
    with pytest.raises(RecipeError) as err:
        recipe_for(model_type, embedding="sparse")
    assert err.value.key == "embedding"


def test_export_refuses_a_sparse_folder_which_loads_as_it_is(sparse_recipe, tmp_path):
    from vembed.export import ExportError, export_sentence_transformers

    _adapter(sparse_recipe()).save(tmp_path / "model")
    with pytest.raises(ExportError, match="SparseEncoder"):
        export_sentence_transformers(tmp_path / "model", tmp_path / "out")
    assert not (tmp_path / "out").exists()
