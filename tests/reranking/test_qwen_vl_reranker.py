"""The Qwen-VL reranker on tiny random-init Qwen2-VL, Qwen2.5-VL and Qwen3-VL models: its score is the "yes" minus
"no" logit of the released reranker's chat template (computed here by hand from the transformers model), it trains
with every ranking loss, its final/ folder is a plain ForConditionalGeneration checkpoint scoring as vembed does, and
text + image lists evaluate."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import QWEN_BACKBONES, QWEN_PIXELS

from vembed.components import recipe_from_dict
from vembed.data.records import Side
from vembed.errors import RecipeError

# The released Qwen3-VL-Reranker's chat template, written out (QwenLM/Qwen3-VL-Embedding, reranker_template.jinja).
JUDGE_TURN = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
              'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def _build(recipe: dict, backbone: str = "qwen3_vl", seed: int = 0, **changes):
    from vembed.reranking import RERANKERS

    torch.manual_seed(seed)
    from rerank_lists import qwen_reranker_config

    built = recipe_from_dict({**recipe, "model_config": qwen_reranker_config(backbone), **changes})
    return RERANKERS.get("qwen_vl_reranker").from_recipe(built).eval()


def _pairs(image_dir):
    from rerank_lists import write_images

    images = [str(image_dir / name) for name in write_images(image_dir)]
    queries = ["a photo of a red square", "blue circle", "a green star", "white page", "a photo"]
    documents = ["a red square on white", Side(text="a star", image=images[0]), Side(image=images[1]),
                 "", Side(text="two", image=[images[2], images[3]])]
    return queries, documents


def _by_hand(model, tokenizer, processor, query: str, document: Side | str) -> float:
    """The yes-minus-no logit at the last token of the template, from the transformers model's own logits."""
    document = document if isinstance(document, Side) else Side(text=document)
    inputs, pads = {}, ""
    if document.images:
        from PIL import Image

        processed = processor(images=[Image.open(path).convert("RGB") for path in document.images],
                              return_tensors="pt")
        inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        pads = "".join("<|vision_start|>" + "<|image_pad|>" * (int(grid.prod()) // processor.merge_size**2)
                       + "<|vision_end|>" for grid in processed["image_grid_thw"])
    text = document.text if document.text else ("" if pads else "NULL")
    prompt = (f"{JUDGE_TURN}<Instruct>: {INSTRUCTION}<Query>:{query}\n<Document>:{pads}{text}<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                       mm_token_type_ids=(ids == image_pad).long(), **inputs).logits[0, -1]
    vocab = tokenizer.get_vocab()
    return float(logits[vocab["yes"]] - logits[vocab["no"]])


@pytest.mark.parametrize("backbone", list(QWEN_BACKBONES))
def test_the_score_is_the_yes_minus_no_logit_of_the_released_template(qwen_rerank_recipe, backbone, tmp_path):
    reranker = _build(qwen_rerank_recipe, backbone)
    queries, documents = _pairs(tmp_path / "images")
    scores = reranker.score(queries, documents, batch_size=3)  # batches mixing text and image pairs, padded
    expected = torch.tensor([_by_hand(reranker.model, reranker.tokenizer, reranker.image_processor, q, d)
                             for q, d in zip(queries, documents)])
    assert scores.shape == (5,) and scores.std() > 0
    assert torch.allclose(scores, expected, atol=1e-5, rtol=1e-4), (scores, expected)


def test_truncation_cuts_the_document_text_and_keeps_template_and_images(qwen_rerank_recipe, tmp_path):
    reranker = _build(qwen_rerank_recipe)
    queries, documents = _pairs(tmp_path / "images")
    whole = reranker.preprocess([queries[1]], [documents[1]])["input_ids"][0].tolist()
    long = Side(text="a star " + "red square " * 40, image=documents[1].images)
    cut = reranker._truncate(reranker.preprocess([queries[1]], [long])["input_ids"][0].tolist())
    limited = _build(qwen_rerank_recipe, max_length=len(whole) + 3)
    ids = limited.preprocess([queries[1]], [long])["input_ids"][0].tolist()
    assert len(ids) == len(whole) + 3 and len(cut) > len(ids)
    ending = reranker._encode_text("<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-len(ending):] == ending and ids.count(reranker._token_ids["image_token_id"]) == whole.count(
        reranker._token_ids["image_token_id"])


def _scored_lists(path):
    """The image lists with a teacher's scores instead of labels (the positive first), for the distillation losses."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    scored = path.with_name("scored.jsonl")
    scored.write_text("".join(json.dumps({"query": row["query"], "documents": row["documents"],
                                          "scores": [3.0, 0.5, -1.0]}) + "\n" for row in rows))
    return scored


@pytest.mark.parametrize("loss", ["rerank_bce", "rerank_listwise", "lambdaloss", "rerank_margin_mse",
                                  "rerank_distill_kl"])
def test_a_few_steps_lower_every_ranking_loss_with_lora(qwen_rerank_recipe, loss):
    from vembed.training.loop import Trainer

    data = qwen_rerank_recipe["data"]["train"]
    if loss in ("rerank_margin_mse", "rerank_distill_kl"):
        from pathlib import Path

        data = str(_scored_lists(Path(data)))
    raw = dict(qwen_rerank_recipe, loss_type=loss, data={"train": data}, use_lora=True, lora_r=8, lora_alpha=16)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = trainer.loader.collate_fn([trainer.dataset[i] for i in range(3)])
    assert "pixel_values" in batch["pairs"]  # image documents in the batch
    trainable = [p for p in trainer.objective.parameters() if p.requires_grad]
    names = [n for n, p in trainer.objective.named_parameters() if p.requires_grad]
    assert names and [n for n in names if not ("lora_" in n or ".visual." in n)] == []  # LoRA, the vision tower
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    losses = []
    for _ in range(3):
        value = trainer.model(batch)
        losses.append(float(value))
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[2] < losses[1] < losses[0], losses


def test_pairs_in_chunks_with_their_images_give_the_gradients_of_one_forward(qwen_rerank_recipe):
    """pairs_per_chunk slices each chunk's pixels with its pairs (image rows are patches, not pairs) and the
    checkpointed chunks give the gradients of one forward."""
    from test_cross_encoder import _gradients

    raw = dict(qwen_rerank_recipe, model_config=dict(qwen_rerank_recipe["model_config"], initializer_range=0.2))
    whole = _gradients(raw, [0, 1, 2])
    chunked = _gradients(dict(raw, pairs_per_chunk=4), [0, 1, 2])  # 9 pairs: 4 + 4 + 1, images in each chunk
    assert whole.keys() == chunked.keys() and any(".visual." in name for name in whole)
    reference = torch.cat([grad.flatten() for grad in whole.values()])
    actual = torch.cat([chunked[name].flatten() for name in whole])
    assert ((actual - reference).norm() / reference.norm()).item() <= 1e-5


def test_final_folder_is_a_plain_checkpoint_that_scores_as_vembed(qwen_rerank_recipe, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from vembed.models.qwen_vl import set_pixel_budget
    from vembed.reranking import load_reranker
    from vembed.training.loop import Trainer

    raw = dict(qwen_rerank_recipe, use_lora=True, lora_r=4, lora_alpha=8, max_steps=2)
    result = Trainer(recipe_from_dict(raw)).run()
    final = result.final_model_dir
    assert json.loads((final / "vembed.json").read_text())["model_type"] == "qwen_vl_reranker"
    reranker = load_reranker(final)
    queries, documents = _pairs(tmp_path / "images")
    ours = reranker.score(queries, documents)
    # What the released reranker's users do: the class from transformers, the tokenizer and image processor saved.
    model = AutoModelForImageTextToText.from_pretrained(final).eval()
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert not any("lora" in name for name in model.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(final)
    processor = reranker.image_processor
    set_pixel_budget(processor, None, None)  # the saved processor's own bounds
    theirs = torch.tensor([_by_hand(model, tokenizer, processor, q, d) for q, d in zip(queries, documents)])
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours, theirs)

    # Saved and reloaded in vembed: the same scores (LoRA merged on save).
    trained = _build(qwen_rerank_recipe, seed=1)
    trained.apply_lora(recipe_from_dict(raw))
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    before = trained.score(queries, documents)
    trained.save(tmp_path / "saved")
    after = load_reranker(tmp_path / "saved").score(queries, documents)
    assert torch.allclose(before, after, atol=1e-6, rtol=0), (before - after).abs().max()


def test_text_and_image_candidates_of_a_corpus_rerank(qwen_rerank_recipe, tmp_path):
    from rerank_lists import write_images

    from vembed.data.corpus import load_corpus_split, write_corpus_folder
    from vembed.reranking.evaluation import rerank_run

    folder = tmp_path / "corpus"
    images = write_images(folder)
    documents = {f"d{i}": ({"text": "a star", "image": images[i % 4]} if i % 2 else {"text": f"a red square {i}"})
                 for i in range(6)}
    queries = {"q0": {"text": "a red square"}, "q1": {"text": "a star"}}
    write_corpus_folder(folder, documents, queries, {"test": {"q0": {"d0": 1}, "q1": {"d1": 2, "d3": 1}}})
    split = load_corpus_split(folder, "test")
    run = {"q0": {f"d{i}": 6.0 - i for i in range(6)}, "q1": {f"d{i}": float(i) for i in range(6)}}
    reranker = _build(qwen_rerank_recipe)
    seen = []

    def score(queries, documents):
        seen.extend(documents)
        return reranker.score(queries, documents)

    metrics = rerank_run(score, split, run, depth=6)
    assert sum(isinstance(d, Side) and len(d.images) == 1 for d in seen) == 6  # the image documents, as images
    assert metrics["reranked/num_queries"] == 2 and 0 < metrics["reranked/ndcg@10"] <= 1


def test_a_checkpoint_without_lm_head_is_refused_in_one_line(qwen_rerank_recipe, tmp_path, capsys):
    from vembed.cli import main
    from vembed.models import MODELS

    embedder = recipe_from_dict({"model_type": "qwen_vl", "model_config": qwen_rerank_recipe["model_config"],
                                 "tokenizer_name": qwen_rerank_recipe["tokenizer_name"], **QWEN_PIXELS})
    MODELS.get("qwen_vl").from_recipe(embedder).save(tmp_path / "embedder")  # a bare Qwen3VLModel folder
    raw = {key: value for key, value in qwen_rerank_recipe.items() if key not in ("model_config", "tokenizer_name")}
    from vembed.reranking import RERANKERS

    with pytest.raises(RecipeError, match="Qwen3VLModel checkpoint, saved without an LM head"):
        RERANKERS.get("qwen_vl_reranker").check_recipe(
            recipe_from_dict({**raw, "model_name": str(tmp_path / "embedder")}))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({**raw, "model_name": str(tmp_path / "embedder")}))
    capsys.readouterr()
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()  # the launch line, then the error in one line
    assert "Traceback" not in err and "model_name" in err.splitlines()[-1], err
    assert "without an LM head" in err.splitlines()[-1]
    assert not (tmp_path / "run" / "final").exists()


def test_an_image_document_handed_to_the_text_cross_encoder_is_refused_in_one_line(
        rerank_recipe, qwen_rerank_recipe, tmp_path, capsys):
    from vembed.cli import main

    lists = qwen_rerank_recipe["data"]["train"]
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(dict(rerank_recipe, data={"train": lists})))
    capsys.readouterr()
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()  # the launch line, then the error in one line
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"data error: {lists}, row 1: holds an image document, which model_type cross_encoder (text only) cannot "
        "read; use model_type qwen_vl_reranker or give text documents")
