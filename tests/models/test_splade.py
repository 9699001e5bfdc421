"""`embedding: sparse` on the text adapter (vembed/models/splade.py): SPLADE's vocabulary-sized vectors from a tiny
random-init BERT's masked-LM head, equal to sentence-transformers' SparseEncoder on the folder vembed saves; pruning
at inference only; and the recipes refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from models.conftest import NO_DROPOUT, SMALL

import vembed
from vembed.components import recipe_from_dict
from vembed.data.records import Side
from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.splade import STATIC_FOLDER, idf_weights, keep_top_k, splade_pool, static_query_vectors

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
    ({"embedding": "single", "query_encoder": "static"}, "query_encoder"),
    ({"static_query_lr": 0.1}, "static_query_lr"),
    ({"static_query_init": "ones"}, "static_query_init"),
    ({"query_encoder": "static", "static_query_init": "missing.json"}, "static_query_init"),
    ({"flops_document_weight": 1e-3, "flops_warmup_ratio": 1.5}, "flops_warmup_ratio"),
    ({"flops_document_weight": 1e-3, "flops_warmup_ratio": -0.1}, "flops_warmup_ratio"),
    ({"flops_warmup_ratio": 0.3}, "flops_warmup_ratio"),
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


# --- inference-free SPLADE (query_encoder: static) --------------------------------------------------------------------

def test_static_query_vectors_are_the_weights_of_each_attended_token_once():
    weight = torch.tensor([0.5, 2.0, -1.0, 3.0, 7.0])
    ids = torch.tensor([[1, 3, 1, 0], [4, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # token 0 is padding in both rows: no weight
    assert torch.equal(static_query_vectors(ids, mask, weight),
                       torch.tensor([[0.0, 2.0, 0.0, 3.0, 0.0], [0.0, 0.0, -1.0, 0.0, 7.0]]))


class _WordTokenizer:
    """Splits on spaces; each word's id is its letter's place in the alphabet (a: 0)."""

    def __call__(self, texts, add_special_tokens, truncation, max_length):
        assert add_special_tokens is False  # tokenised as queries are
        ids = [[ord(word) - ord("a") for word in text.split()] for text in texts]
        return {"input_ids": [row[:max_length] if truncation else row for row in ids]}


def test_idf_weights_count_each_distinct_document_once_bm25_style():
    # Distinct documents: "a b", "a c", "a a d" (N = 3; the repeated "a b" is one document). df: a 3, b 1, c 1, d 1,
    # e 0; with max_length 2 the third is "a a": d is cut, df(d) = 0.
    weights = idf_weights(["a b", "a c", "a b", "a a d"], _WordTokenizer(), vocab_size=5, max_length=2)
    idf = [math.log(1 + (3 - df + 0.5) / (df + 0.5)) for df in (3, 1, 1, 0, 0)]
    torch.testing.assert_close(weights, torch.tensor(idf), atol=1e-6, rtol=0)
    assert weights.dtype == torch.float32


@pytest.fixture(scope="module")
def static_recipe(sparse_recipe, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir).get_vocab())

    def make(**changes):
        raw = sparse_recipe(query_encoder="static", **changes)
        return {**raw, "model_config": {**raw["model_config"], "vocab_size": vocab_size}}

    return make


def _queries(adapter, texts=TEXTS):
    with torch.no_grad():
        return adapter.encode(adapter.preprocess([Side(text=t, role="query") for t in texts]))


@pytest.mark.parametrize("changes", [{}, {"sparse_pooling": "sum", "max_length": 4}], ids=["max", "sum_truncated"])
def test_an_inference_free_model_is_a_sentence_transformers_router_with_equal_query_and_document_vectors(
        static_recipe, changes, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    adapter = _adapter(static_recipe(**changes))
    adapter.initialise_static_query(TEXTS + ["a photo of a cat"])
    with torch.no_grad():  # trained weights: not IDF, some negative (no activation on the static route)
        adapter.static_query_weight.mul_(torch.linspace(-1.0, 2.0, adapter.embedding_dim))
    queries, documents = _queries(adapter), _encode(adapter)
    assert queries.shape == documents.shape == (3, adapter.embedding_dim)
    ids = adapter.tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert torch.equal(queries[1].nonzero().flatten(), torch.tensor(sorted(set(ids))))
    assert torch.equal(queries[1, ids], adapter.static_query_weight.detach()[ids])
    adapter.save(tmp_path)
    assert (tmp_path / STATIC_FOLDER / "model.safetensors").is_file()
    theirs = st.SparseEncoder(str(tmp_path), device="cpu")
    assert type(theirs[0]).__name__ == "Router" and theirs.similarity_fn_name == "dot"
    their_queries = theirs.encode_query(TEXTS, convert_to_tensor=True).to_dense()
    their_documents = theirs.encode_document(TEXTS, convert_to_tensor=True).to_dense()
    torch.testing.assert_close(their_queries, queries, atol=1e-5, rtol=0)
    torch.testing.assert_close(their_documents, documents, atol=1e-5, rtol=0)
    # vembed loads it back: queries through the static weights, documents (and role-less texts) through the model
    model = vembed.load(str(tmp_path), device="cpu")
    torch.testing.assert_close(model.encode(TEXTS, role="query"), queries, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.encode(TEXTS, role="document"), documents, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.encode(TEXTS), documents, atol=1e-6, rtol=0)
    # and training continues from it with its weights, whatever static_query_init says
    raw = {**static_recipe(**changes), "model_name": str(tmp_path), "static_query_init": "ones"}
    raw.pop("model_config")
    continued = _adapter(raw)
    assert torch.equal(continued.static_query_weight, adapter.static_query_weight)


def test_static_weights_from_an_idf_json_equal_sentence_transformers_from_json(static_recipe, tmp_path):
    st_modules = pytest.importorskip("sentence_transformers.sparse_encoder.modules")
    adapter = _adapter(static_recipe())
    tokens = list(adapter.tokenizer.get_vocab())[5:12]
    table = {token: 0.25 * i + 0.5 for i, token in enumerate(tokens)}
    (tmp_path / "idf.json").write_text(json.dumps(table))
    from_file = _adapter(static_recipe(static_query_init=str(tmp_path / "idf.json")))
    theirs = st_modules.SparseStaticEmbedding.from_json(str(tmp_path / "idf.json"), tokenizer=adapter.tokenizer)
    assert torch.equal(from_file.static_query_weight.detach(), theirs.weight.detach())
    assert (from_file.static_query_weight != 0).sum() == len(table)
    assert torch.equal(_adapter(static_recipe(static_query_init="ones")).static_query_weight.detach(),
                       torch.ones(adapter.embedding_dim))


def test_a_static_query_encoder_refuses_a_mixed_batch_and_a_vocabulary_its_tokenizer_lacks(static_recipe):
    adapter = _adapter(static_recipe())
    with pytest.raises(ValueError, match="queries or documents, not both"):
        adapter.preprocess([Side(text="q", role="query"), Side(text="d", role="document")])
    raw = static_recipe()
    err = _refusal({**raw, "model_config": {**raw["model_config"], "vocab_size": 310}})
    assert err.key == "query_encoder" and "310" in err.message


def test_static_queries_cost_no_model_flops(static_recipe):
    adapter = _adapter(static_recipe())
    queries = adapter.preprocess([Side(text=t, role="query") for t in TEXTS])
    documents = adapter.preprocess([Side(text=t, role="document") for t in TEXTS])
    assert adapter.forward_flops(queries) == 0 and int(adapter.forward_flops(documents)) > 0
