"""The cross-encoder reranker: trained through the loop, its final/ scores in sentence-transformers' CrossEncoder as
in vembed; lists in chunks give the unchunked gradients; bad lists and GradCache are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from vembed.components import recipe_from_dict
from vembed.errors import DataError, RecipeError

PAIRS = [("a photo of a red square", "a red square on white"),
         ("a photo of a red square", "two black lines crossing " * 12),  # cut to max_length, as CrossEncoder cuts
         ("blue circle", "a small yellow star"), ("green", "an empty white page")]


def test_final_folder_scores_in_sentence_transformers_cross_encoder(rerank_recipe):
    from sentence_transformers.cross_encoder import CrossEncoder

    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.training.loop import Trainer

    result = Trainer(recipe_from_dict(rerank_recipe)).run()
    final = result.final_model_dir
    ours = CrossEncoderAdapter.load(final).score([q for q, _ in PAIRS], [d for _, d in PAIRS])
    theirs = CrossEncoder(str(final), device="cpu").predict(PAIRS, convert_to_tensor=True).float()
    assert ours.shape == (len(PAIRS),)
    assert ours.std() > 0  # the pairs are scored apart, not one constant
    assert torch.allclose(ours, theirs.cpu(), atol=1e-5, rtol=0), (ours, theirs)
    assert json.loads((final / "vembed.json").read_text())["model_type"] == "cross_encoder"
    assert result.metrics["train"]["steps"] == 2
    # What embeds refuses it (vembed.load, vembed mine, vembed eval of an embedder), and it refuses an embedder.
    from vembed.models import load_adapter

    with pytest.raises(RecipeError, match="holds a 'cross_encoder' model, which is not an embedding model: a "
                                          "reranker scores .* and embeds nothing"):
        load_adapter(final)
    (final / "vembed.json").write_text(json.dumps({"model_type": "text", "settings": {}}))
    with pytest.raises(RecipeError, match="holds a 'text' model, not a reranker"):
        CrossEncoderAdapter.load(final)


def _gradients(raw: dict, rows: list[int]) -> dict[str, torch.Tensor]:
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    loss = trainer.model(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]))
    trainer.accelerator.backward(loss)
    return {n: p.grad.detach().clone() for n, p in trainer.objective.named_parameters() if p.grad is not None}


def test_lists_in_chunks_give_the_gradients_of_one_forward(rerank_recipe):
    whole = _gradients(rerank_recipe, [0, 1, 2, 3])
    chunked = _gradients(dict(rerank_recipe, pairs_per_chunk=3), [0, 1, 2, 3])  # 16 pairs in chunks of 3
    assert whole.keys() == chunked.keys() and len(whole) > 10
    for name, grad in whole.items():
        assert torch.allclose(chunked[name], grad, atol=1e-6, rtol=1e-5), name


def test_length_chunks_score_pairs_in_length_sorted_groups_with_the_gradients_of_one_forward(rerank_recipe):
    """`length_chunks: 3`: three forwards, each only as wide as its longest pair, and the gradients of one padded
    forward (with pairs_per_chunk inside the groups too)."""
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(dict(rerank_recipe, length_chunks=3)))
    trainer.build()
    batch = trainer.loader.collate_fn([trainer.dataset[i] for i in [0, 1, 2, 3]])
    widths: list[int] = []
    hook = trainer.adapter.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    trainer.model(batch)
    hook.remove()
    full = batch["pairs"]["input_ids"].shape[1]
    assert len(widths) == 3 and max(widths) == full and min(widths) < full, (widths, full)
    whole = _gradients(rerank_recipe, [0, 1, 2, 3])
    for chunked in (_gradients(dict(rerank_recipe, length_chunks=3), [0, 1, 2, 3]),
                    _gradients(dict(rerank_recipe, length_chunks=2, pairs_per_chunk=3), [0, 1, 2, 3])):
        assert whole.keys() == chunked.keys()
        for name, grad in whole.items():
            assert torch.allclose(chunked[name], grad, atol=1e-6, rtol=1e-5), name


def test_list_with_mismatched_labels_names_file_and_row(rerank_recipe, tmp_path):
    from vembed.reranking.data import read_lists

    bad = tmp_path / "bad.jsonl"
    rows = [{"query": "q", "documents": ["a", "b"], "labels": [1, 0]},
            {"query": "r", "documents": ["a", "b", "c"], "labels": [1, 0]}]
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = recipe_from_dict(dict(rerank_recipe, data={"train": str(bad)}))
    with pytest.raises(DataError) as error:
        read_lists(recipe.data, "train")
    assert str(error.value) == f"data error: {bad}, row 2: has 3 documents but 2 labels; give one label per document"


def test_judged_pairs_file_groups_rows_by_query(rerank_recipe, tmp_path):
    from vembed.reranking.data import read_lists

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"query": "q", "document": "a", "label": 1}, {"query": "r", "document": "b", "label": 0.5},
            {"query": "q", "document": "c", "label": 0}]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lists, report = read_lists(recipe_from_dict(dict(rerank_recipe, data={"train": str(pairs)})).data, "train")
    assert [(item.query, item.documents, item.labels) for item in lists] == [
        ("q", ["a", "c"], [1.0, 0.0]), ("r", ["b"], [0.5])]
    assert report.pairs == 3


def test_gradient_cache_is_refused_before_any_weight_is_read(rerank_recipe, monkeypatch):
    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.training.loop import Trainer

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(CrossEncoderAdapter, "from_recipe", no_weights)
    with pytest.raises(RecipeError) as error:
        Trainer(recipe_from_dict(dict(rerank_recipe, use_gradient_cache=True)))
    assert error.value.key == "use_gradient_cache"
    assert "not needed" in str(error.value) and "no in-batch negatives" in str(error.value)


def test_corpus_folder_and_mined_negatives_give_positive_first_lists(rerank_recipe, tmp_path):
    from corpora import make_corpus_folder, write_negatives

    from vembed.reranking.data import read_lists

    folder = make_corpus_folder(tmp_path / "corpus")
    negatives = write_negatives(tmp_path / "negatives.jsonl")
    data = {"train": str(folder), "hard_negatives": str(negatives), "num_hard_negatives": 2}
    lists, report = read_lists(recipe_from_dict(dict(rerank_recipe, data=data)).data, "train")
    assert len(lists) == report.kept == 13  # as the contrastive task reads the same folder and file
    first = lists[0]  # q0 with d0 (grade 2), its two mined negatives d1, d3 (d6, judged relevant, dropped)
    assert first.query == "a photo of a red square"
    assert first.documents == ["square a red square on blue", "circle a red circle on green",
                               "star a red star on black"]
    assert first.labels == [1.0, 0.0, 0.0]


def test_vembed_train_refuses_a_mismatched_list_in_one_line_and_writes_nothing(rerank_recipe, tmp_path, capsys):
    import yaml

    from vembed.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "documents": ["a", "b"], "labels": [1]}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dict(rerank_recipe, data={"train": str(bad)})))
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()  # the launch line, then the error in one line
    says = f"data error: {bad}, row 1: has 2 documents but 1 labels; give one label per document"
    assert err.splitlines()[-1] == says
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "final").exists()


def test_lora_trains_the_score_head_in_full_and_saves_a_merged_cross_encoder(rerank_recipe):
    from sentence_transformers.cross_encoder import CrossEncoder

    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.training.loop import Trainer

    raw = dict(rerank_recipe, use_lora=True, lora_r=4, learning_rate=1e-2)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    trainable = {name for name, p in trainer.objective.adapter.named_parameters() if p.requires_grad}
    assert {"model.classifier.weight", "model.classifier.bias"} <= trainable
    assert any("lora_" in name for name in trainable)
    assert not any(name.startswith("model.bert.") and "lora_" not in name for name in trainable)
    result = trainer.run()
    ours = CrossEncoderAdapter.load(result.final_model_dir).score([q for q, _ in PAIRS], [d for _, d in PAIRS])
    theirs = CrossEncoder(str(result.final_model_dir), device="cpu").predict(PAIRS, convert_to_tensor=True).float()
    assert torch.allclose(ours, theirs.cpu(), atol=1e-5, rtol=0), (ours, theirs)


@pytest.mark.parametrize("recipe_fixture", ["rerank_recipe", "qwen_rerank_recipe"])
def test_loader_workers_tokenize_the_same_batches_as_the_training_process(recipe_fixture, request, tmp_path,
                                                                          monkeypatch):
    """configs/reranker_minilm.yaml and qwen3_vl_reranker.yaml set data.num_workers: the pairs are tokenized (and
    images read) in the loader's workers (the collate function), beside the step; the run must take the same steps as
    with the loader in the process."""
    import os

    from vembed.reranking import data
    from vembed.training.loop import Trainer

    collated_in = tmp_path / "collated_in.txt"
    collate = data.collate_lists

    def recording_collate(adapter, lists):  # which process tokenized each batch (workers are forked: it is theirs)
        with open(collated_in, "a") as log:
            log.write(f"{os.getpid()}\n")
        return collate(adapter, lists)

    monkeypatch.setattr(data, "collate_lists", recording_collate)
    rerank_recipe = request.getfixturevalue(recipe_fixture)

    def losses(workers: int, name: str) -> list[float]:
        raw = dict(rerank_recipe, output_dir=str(tmp_path / name),
                   data={**rerank_recipe["data"], "num_workers": workers})
        history = Trainer(recipe_from_dict(raw)).run().metrics["loss_history"]
        return [record["loss"] for record in history]

    in_process = losses(0, "in-process")
    assert set(collated_in.read_text().split()) == {str(os.getpid())}
    collated_in.unlink()
    in_workers = losses(2, "workers")
    assert str(os.getpid()) not in collated_in.read_text().split()  # tokenized beside the step, not in it
    assert len(in_process) >= 2 and len(set(in_process)) == len(in_process)  # different batches, each logged
    assert in_workers == in_process


def test_packed_pairs_give_the_gradients_of_one_padded_forward(rerank_recipe):
    """`packing: true`: the encoder runs the pairs as one row of real tokens, the pooler and score head read them
    unpacked; loss and gradients are those of the padded forward (dropout off), with pairs_per_chunk too."""
    config = {**rerank_recipe["model_config"], "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    raw = dict(rerank_recipe, model_config=config)
    whole = _gradients(raw, [0, 1, 2, 3])
    from vembed.training.loop import Trainer

    keys = {}
    for name, extra in (("padded", {}), ("packed", {"packing": True})):
        trainer = Trainer(recipe_from_dict(dict(raw, **extra)))
        trainer.build()
        keys[name] = list(trainer.objective.state_dict())
    assert keys["packed"] == keys["padded"]  # checkpoints of either load into the other
    for packed in (_gradients(dict(raw, packing=True), [0, 1, 2, 3]),
                   _gradients(dict(raw, packing=True, pairs_per_chunk=5), [0, 1, 2, 3])):
        assert whole.keys() == packed.keys() and len(whole) > 10
        for name, grad in whole.items():
            assert torch.allclose(packed[name], grad, atol=1e-6, rtol=1e-5), name


def test_flops_of_a_forward_match_torchs_counter_and_training_logs_mfu(rerank_recipe):
    """The numerator of the loop's MFU: 2 x weights x real tokens (vembed/models/flops.py), the pooler and score head
    once per pair; padding costs nothing."""
    from torch.utils.flop_counter import FlopCounterMode

    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.training.loop import Trainer

    adapter = CrossEncoderAdapter.from_recipe(recipe_from_dict(rerank_recipe))
    queries, documents = [q for q, _ in PAIRS], [d for _, d in PAIRS]
    inputs = adapter.preprocess(queries, documents)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter(inputs)
    # The rule leaves out attention's T^2 term: close to torch's count, not equal.
    assert float(adapter.forward_flops(inputs)) == pytest.approx(counter.get_total_flops(), rel=0.25)
    alone = [float(adapter.forward_flops(adapter.preprocess([q], [d]))) for q, d in PAIRS]
    assert len(set(alone)) > 1  # pairs of different lengths: the batch of them pads the shorter ones
    assert float(adapter.forward_flops(inputs)) == pytest.approx(sum(alone))  # padding costs nothing
    bert = adapter.model  # BertForSequenceClassification: pooler and classifier run once per pair
    size = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    # Every weight but the embedding tables (looked up, not multiplied) sees every token: the layers and the
    # embeddings' LayerNorm.
    per_token = size(bert.bert.encoder) + size(bert.bert.embeddings.LayerNorm)
    per_pair = size(bert.bert.pooler) + size(bert.classifier)
    assert float(adapter.forward_flops(inputs)) == 2 * (per_token * int(inputs["attention_mask"].sum())
                                                        + per_pair * len(PAIRS))
    history = Trainer(recipe_from_dict(dict(rerank_recipe, max_steps=1, logging_steps=1))).run().metrics["loss_history"]
    assert 0 < history[0]["mfu"] <= 1
