"""The text adapter's token vectors (`embedding: multi_vector`, ColBERT) on a tiny random-init BERT: query expansion,
prefixes, the punctuation skip-list, the projection, saving and loading, and the keys other adapters refuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models.conftest import NO_DROPOUT, SMALL

from vembed.data.records import Side
from vembed.errors import RecipeError
from vembed.models.token_vectors import token_mask

QUERY_LENGTH = 10


@pytest.fixture
def colbert_raw(mask_tokenizer_dir, token_ids):
    config = {"model_type": "bert", **SMALL, **token_ids, "vocab_size": 301, "max_position_embeddings": 24,
              **NO_DROPOUT}
    return {"model_type": "text", "tokenizer_name": mask_tokenizer_dir, "model_config": config,
            "embedding": "multi_vector", "multi_vector_dim": 16, "query_length": QUERY_LENGTH,
            "loss_type": "late_interaction"}


@pytest.fixture
def colbert(colbert_raw):
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    torch.manual_seed(0)
    return MODELS.get("text").from_recipe(recipe_from_dict(colbert_raw)).eval()


def _queries():
    return [Side("a red square", role="query"), Side("blue", role="query")]


def _documents():
    return [Side("a red, white.", role="document"), Side("a star", role="document")]


def test_queries_are_prefixed_and_expanded_with_attended_mask_tokens(colbert):
    batch = colbert.preprocess(_queries())
    ids, tokenizer = batch["input_ids"], colbert.tokenizer
    assert ids.shape == (2, QUERY_LENGTH) and bool(batch["attention_mask"].all())
    prefix = ids[0, 1]  # one token added after the vocabulary (the tiny tokenizer lower-cases it)
    assert prefix > tokenizer.mask_token_id and (ids[:, 1] == prefix).all()
    assert tokenizer.convert_ids_to_tokens(int(prefix)).lower() == "[q] "
    assert (ids[1, -3:] == tokenizer.mask_token_id).all()  # "blue" is short: the rest is expansion
    vectors = colbert.encode(batch)
    assert vectors.shape == (2, QUERY_LENGTH, 16)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(2, QUERY_LENGTH))  # every position is a token


def test_document_vectors_are_the_projected_normalised_states_of_kept_tokens(colbert):
    batch = colbert.preprocess(_documents())
    tokens = colbert.tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens[1].lower() == "[d] " and "," in tokens and "." in tokens
    with torch.no_grad():
        vectors = colbert.encode(batch)
        hidden = colbert.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    expected = F.normalize(hidden @ colbert.projection.weight.T, dim=-1)
    for row in range(2):
        for position, token_id in enumerate(batch["input_ids"][row].tolist()):
            text = colbert.tokenizer.convert_ids_to_tokens(token_id)
            if batch["attention_mask"][row, position] == 0 or text in {",", "."}:
                assert vectors[row, position].abs().max() == 0, (row, position, text)  # padding, punctuation
            else:
                torch.testing.assert_close(vectors[row, position], expected[row, position], atol=1e-5, rtol=0)
    assert token_mask(vectors)[1].sum() == batch["attention_mask"][1].sum()  # nothing to skip in "a star"


def test_skip_punctuation_false_keeps_punctuation(colbert_raw):
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    adapter = MODELS.get("text").from_recipe(recipe_from_dict(dict(colbert_raw, skip_punctuation=False)))
    batch = adapter.preprocess(_documents())
    assert torch.equal(batch["token_vector_mask"], batch["attention_mask"].bool())


def test_saved_model_loads_with_its_projection_and_gives_the_same_vectors(colbert, tmp_path):
    from vembed.models.base import load_adapter

    colbert.save(tmp_path)
    assert (tmp_path / "1_Dense" / "model.safetensors").is_file()
    loaded = load_adapter(tmp_path).eval()
    assert loaded.settings.multi_vector and loaded.embedding_dim == 16
    for sides in (_queries(), _documents()):
        with torch.no_grad():
            torch.testing.assert_close(loaded.encode(loaded.preprocess(sides)),
                                       colbert.encode(colbert.preprocess(sides)))


def test_projection_is_trained(colbert):
    assert colbert.projection.weight.requires_grad and colbert.projection.bias is None
    assert any(p is colbert.projection.weight for p in colbert.parameters())


@pytest.mark.parametrize("model_type", ["clip", "siglip", "composed"])  # text and qwen_vl (ColQwen) give them
def test_adapters_without_token_vectors_refuse_the_key(recipe_for, model_type):
    with pytest.raises(RecipeError, match="embedding"):
        recipe_for(model_type, embedding="multi_vector")


@pytest.mark.parametrize("changes, key", [
    ({"embedding": "single"}, "multi_vector_dim"),  # a multi_vector key with embedding: single
    ({"normalize": False}, "normalize"),
    ({"query_length": 64}, "query_length"),  # past the 24 positions
])
def test_bad_multi_vector_keys_name_the_key(colbert_raw, changes, key):
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    with pytest.raises(RecipeError) as err:
        MODELS.get("text").from_recipe(recipe_from_dict(dict(colbert_raw, **changes)))
    assert err.value.key == key


def test_tokenizer_without_a_mask_token_is_refused(colbert_raw, tiny_tokenizer_dir):
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    with pytest.raises(RecipeError, match="mask token"):
        MODELS.get("text").from_recipe(recipe_from_dict(dict(colbert_raw, tokenizer_name=tiny_tokenizer_dir)))


def test_the_planned_vector_size_is_the_token_vectors_only_with_token_vectors(colbert_raw):
    """`embedding_dim_for` (what `vembed plan` and the GradCache buffers size by, before a model exists): the token
    vector size with `embedding: multi_vector`, the encoder's width without (mutmut found it untested)."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    text = MODELS.get("text")
    assert text.embedding_dim_for(recipe_from_dict(colbert_raw)) == 16
    single = {k: v for k, v in colbert_raw.items()
              if k not in ("embedding", "multi_vector_dim", "query_length", "loss_type")}
    assert text.embedding_dim_for(recipe_from_dict(single)) == colbert_raw["model_config"]["hidden_size"]
