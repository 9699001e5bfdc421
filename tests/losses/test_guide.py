"""GISTEmbed's guide: a folder vembed saved or a sentence-transformers folder loads frozen; anything else is a
RecipeError naming gist_guide."""

from __future__ import annotations

import json

import pytest
import torch

from vembed.errors import RecipeError
from vembed.losses.guide import check_guide_folder, load_guide

BERT = {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
        "num_attention_heads": 4, "max_position_embeddings": 32}


def test_a_sentence_transformers_folder_guides_as_sentence_transformers_embeds(tmp_path, tiny_tokenizer_dir):
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = tmp_path / "st"
    torch.manual_seed(0)
    BertModel(BertConfig(**{k: v for k, v in BERT.items() if k != "model_type"})).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                  "pooling_mode_mean_tokens": True}))
    (folder / "2_Normalize").mkdir()
    guide = load_guide(str(folder))
    assert not any(p.requires_grad for p in guide.parameters())
    from vembed.data.records import Side

    texts = ["a red circle", "two blue squares on a line"]
    ours = guide(guide.preprocess([Side(text=t) for t in texts]))
    theirs = st.SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.allclose(ours.float(), theirs.float(), atol=1e-5)


def test_a_folder_without_a_model_is_a_recipe_error_naming_the_key(tmp_path):
    for folder in (tmp_path / "missing", tmp_path):
        with pytest.raises(RecipeError) as found:
            check_guide_folder(str(folder))
        assert found.value.key == "gist_guide"
    (tmp_path / "modules.json").write_text("not json")
    with pytest.raises(RecipeError, match="not a readable sentence-transformers folder"):
        check_guide_folder(str(tmp_path))


def test_a_reranker_is_no_guide_whoever_saved_it(tmp_path, tiny_tokenizer_dir):
    pytest.importorskip("sentence_transformers")
    from tiny_models import save_cross_encoder_folders

    for kind, folder in save_cross_encoder_folders(tmp_path, tiny_tokenizer_dir).items():
        with pytest.raises(RecipeError, match=r"^recipe error: gist_guide: .* is a .*: it scores \(query, document\) "
                                              "pairs and embeds nothing; the guide embeds every batch; name an "
                                              "embedding model$"):
            check_guide_folder(folder)
