"""A ColBERT run end to end on a tiny BERT: the recipe trains through the loop, saves final/, and `vembed.load(final)`
gives the token vectors and MaxSim scores of the adapter that trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from launching import ROOT, launch, train_in_this_process

import vembed
from vembed.components import recipe_from_dict
from vembed.models.maxsim import maxsim

QUERIES = ["question 3", "what shape is it"]
DOCUMENTS = ["answer 3: a shape, a shape.", "wrong.", "another 1"]


@pytest.fixture
def colbert_recipe(tmp_path, mask_tokenizer_dir):
    rows = [{"query": f"question {i}", "positive": f"answer {i}: " + "a shape, " * (i % 4),
             "negatives": ["wrong. " * (1 + i % 3)]} for i in range(16)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "model_type": "text", "tokenizer_name": mask_tokenizer_dir,
        "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32},
        "embedding": "multi_vector", "multi_vector_dim": 16, "query_length": 12, "loss_type": "late_interaction",
        "data": {"train": str(path), "num_hard_negatives": 1}, "output_dir": str(tmp_path / "run"), "batch_size": 4,
        "seed": 0, "max_steps": 3, "learning_rate": 1e-3, "length_chunks": 2,
    }


def _vectors_of(adapter, texts, role):
    from vembed.data.records import Side
    from vembed.models.encoding import encode_sides

    return encode_sides(adapter, [Side(text=t, role=role) for t in texts])


def test_trained_colbert_loads_and_gives_the_training_adapters_token_vectors(colbert_recipe):
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(colbert_recipe))
    result = trainer.run()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.metrics["loss_history"])
    final = Path(colbert_recipe["output_dir"]) / "final"
    assert (final / "1_Dense" / "model.safetensors").is_file()

    model = vembed.load(str(final), device="cpu")
    assert model.multi_vector and model.embedding_dim == 16
    queries, documents = (model.encode_token_vectors(QUERIES, role="query"),
                          model.encode_token_vectors(DOCUMENTS, role="document"))
    assert queries.shape == (2, 12, 16)
    trained = trainer.adapter.cpu()
    torch.testing.assert_close(queries, _vectors_of(trained, QUERIES, "query"), atol=1e-6, rtol=0)
    torch.testing.assert_close(documents, _vectors_of(trained, DOCUMENTS, "document"), atol=1e-6, rtol=0)
    torch.testing.assert_close(model.score(queries, documents), maxsim(queries, documents))
    with pytest.raises(ValueError, match="encode_token_vectors"):
        model.encode(texts=QUERIES)

    # The card shows the token-vector calls, and its vembed snippet runs; no sentence-transformers claim or export.
    from vembed.export import ExportError, export_sentence_transformers

    card = (final / "README.md").read_text()
    assert "encode_token_vectors" in card and "SentenceTransformer(" not in card
    assert "- sentence-transformers\n" not in card  # no such tag in the front matter
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(snippet, namespace)
    assert namespace["scores"].shape == (1, len(namespace["documents"]))
    out = Path(colbert_recipe["output_dir"]) / "exported"
    with pytest.raises(ExportError, match="multi_vector"):
        export_sentence_transformers(final, out)
    assert not out.exists()


def test_multi_vector_needs_a_token_vector_loss_and_corpus_folders_to_evaluate_on(colbert_recipe, tmp_path):
    from vembed.errors import RecipeError
    from vembed.tasks.contrastive import ContrastiveTask

    for changes, key in (({"loss_type": "infonce"}, "loss_type"),
                         ({"data": {**colbert_recipe["data"], "validation": colbert_recipe["data"]["train"]}},
                          "data.validation")):
        with pytest.raises(RecipeError) as err:
            ContrastiveTask.check_recipe(recipe_from_dict({**colbert_recipe, **changes}))
        assert err.value.key == key
    single = {k: v for k, v in colbert_recipe.items() if k not in ("embedding", "multi_vector_dim", "query_length")}
    with pytest.raises(RecipeError) as err:
        ContrastiveTask.check_recipe(recipe_from_dict(single))
    assert err.value.key == "loss_type"


def test_a_colbert_recipe_with_a_corpus_validation_split_evaluates_by_maxsim(colbert_recipe, tmp_path):
    """In-run corpus evaluation searches the corpus with the training adapter's token vectors: the metrics the run
    reports are `evaluate_corpus`'s on that adapter (the same search `vembed eval` runs on final/)."""
    from corpora import make_corpus_folder

    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import evaluate_corpus
    from vembed.training.loop import Trainer

    folder = make_corpus_folder(tmp_path / "corpus")
    recipe = {**colbert_recipe, "data": {**colbert_recipe["data"], "validation": str(folder)}, "max_steps": 2}
    trainer = Trainer(recipe_from_dict(recipe))
    result = trainer.run()
    found = result.metrics["validation"]
    assert trainer.recipe.metric_for_best_model == "corpus/ndcg@10"
    expected = evaluate_corpus(trainer.adapter.cpu(), load_corpus_split(folder, "dev"))
    for name in ("corpus/ndcg@10", "corpus/recall@10", "corpus/mrr@10"):
        assert found[name] == pytest.approx(expected[name], abs=1e-6), name


@pytest.mark.slow
def test_shipped_colbert_recipe_trains_through_vembed_train(colbert_recipe, tmp_path):
    """configs/colbert_minilm.yaml with the tiny BERT in place of MiniLM, through the training entrypoint (in this
    process: a fresh interpreter would add ~10 s of imports to a 2-step run)."""
    shipped = yaml.safe_load((ROOT / "configs" / "colbert_minilm.yaml").read_text())
    shipped.pop("model_name")
    tiny = {k: colbert_recipe[k] for k in ("tokenizer_name", "model_config", "data", "output_dir", "seed")}
    raw = {**shipped, **tiny, "multi_vector_dim": 16, "query_length": 12, "max_length": 32, "batch_size": 4,
           "max_steps": 2, "learning_rate": 1e-3}
    recipe = tmp_path / "colbert.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    train_in_this_process(recipe)
    final = Path(raw["output_dir"]) / "final"
    vectors = vembed.load(str(final), device="cpu").encode_token_vectors(DOCUMENTS, role="document")
    assert vectors.shape[0] == 3 and vectors.shape[2] == 16


@pytest.mark.slow
def test_zero3_colbert_launch_trains_the_weights_of_one_process(colbert_recipe, tmp_path):
    """Token vectors under the shipped ZeRO-3 config on 2 processes, started as users start them: documents of both
    ranks are gathered (padded to the longest) as in-batch negatives, so 3 steps of 4 per rank train the weights one
    process trains on batches of 8 (dropout off). Measured: every parameter within 3e-6 relative. (FSDP2 shards the
    same model state and shares this loss path; tests/training/test_launches.py launches it.)"""
    from launching import final_weights, max_relative_difference, write_recipe

    config_without_dropout = {**colbert_recipe["model_config"], "hidden_dropout_prob": 0.0,
                              "attention_probs_dropout_prob": 0.0}
    base = {**colbert_recipe, "model_config": config_without_dropout}
    reference = tmp_path / "single"
    train_in_this_process(write_recipe(base, reference, batch_size=8))
    launched = tmp_path / "sharded"
    result = launch("deepspeed_zero3.yaml", write_recipe(base, launched, batch_size=4))
    assert "(2 processes)" in result.stdout + result.stderr
    # DeepSpeed on CPU compiles a shared-memory all-reduce op when unasked (~45 s) that training never calls
    assert "shm_comm" not in result.stdout + result.stderr
    got, expected = final_weights(launched), final_weights(reference)
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by a query's scores): it
    # holds rounding noise of ~1e-10, which Adam scales to steps of ~1e-8, different in each launch. Compared
    # absolutely; relative to a tensor of 1e-7 it would differ by ~100%.
    for name in [name for name in expected if name.endswith("attention.self.key.bias")]:
        assert (got.pop(name) - expected.pop(name)).abs().max() <= 1e-6, name
    difference = max_relative_difference(got, expected)
    assert difference <= 1e-4, difference


@pytest.mark.parametrize("loss", ["late_interaction_pairwise", "late_interaction_distill_kl"])
def test_the_other_token_vector_losses_need_multi_vector_and_a_fixed_temperature(colbert_recipe, loss):
    from vembed.errors import RecipeError
    from vembed.tasks.contrastive import ContrastiveTask

    ContrastiveTask.check_recipe(recipe_from_dict({**colbert_recipe, "loss_type": loss}))
    single = {k: v for k, v in colbert_recipe.items() if k not in ("embedding", "multi_vector_dim", "query_length")}
    with pytest.raises(RecipeError, match="scores token vectors; set embedding: multi_vector") as err:
        ContrastiveTask.check_recipe(recipe_from_dict({**single, "loss_type": loss}))
    assert err.value.key == "loss_type"
    names = "late_interaction, late_interaction_distill_kl, late_interaction_pairwise"
    with pytest.raises(RecipeError, match=f"use a loss_type that scores them \\({names}\\)"):
        ContrastiveTask.check_recipe(recipe_from_dict({**colbert_recipe, "loss_type": "infonce"}))
    with pytest.raises(RecipeError, match="keeps its temperature fixed") as err:
        recipe_from_dict({**colbert_recipe, "loss_type": loss, "learnable_temperature": True})
    assert err.value.key == "learnable_temperature"


def test_shipped_colbert_distillation_recipe_trains_from_candidate_lists(colbert_recipe, tmp_path):
    """configs/colbert_minilm_distill.yaml with the tiny BERT, on {query, documents, scores} lines, in-process."""
    from vembed.training.loop import Trainer

    shipped = yaml.safe_load((ROOT / "configs" / "colbert_minilm_distill.yaml").read_text())
    shipped.pop("model_name")
    rows = [{"query": f"question {i}", "documents": [f"answer {i}: a shape", "wrong.", f"another {i}"],
             "scores": [5.0, 1.0 - i % 2, 0.5 * (i % 3)]} for i in range(8)]
    path = tmp_path / "lists.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tiny = {k: colbert_recipe[k] for k in ("tokenizer_name", "model_config", "output_dir", "seed")}
    raw = {**shipped, **tiny, "data": {**shipped["data"], "train": str(path), "num_hard_negatives": 2},
           "multi_vector_dim": 16, "query_length": 12, "max_length": 32, "batch_size": 4, "max_steps": 2,
           "learning_rate": 1e-3}
    Trainer(recipe_from_dict(raw)).run()
    vectors = vembed.load(str(Path(raw["output_dir"]) / "final"), device="cpu").encode_token_vectors(
        DOCUMENTS, role="document")
    assert vectors.shape[0] == 3 and vectors.shape[2] == 16 and torch.isfinite(vectors).all()
