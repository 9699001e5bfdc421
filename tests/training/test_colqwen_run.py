"""ColQwen (qwen_vl, `embedding: multi_vector`) through the training loop on a tiny random-init Qwen3-VL: text queries
against page-screenshot documents (images only). Two gloo ranks equal one process on the whole batch, GradCache
equals the whole batch, and a run's final/ gives the trained adapter's token vectors; under FSDP2 + LoRA (the 8B
recipe's launch) two ranks train and evaluate as one process and the final/ they save gives their token vectors.

Dropout is off (Qwen3-VL's attention_dropout 0): two processes, or chunks, would draw other masks than one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_on_ranks
from tiny_models import QWEN_BACKBONES, QWEN_PIXELS
from training.test_grad_cache import _assert_close, _batch, _grads, _reference_step, _trainer

from vembed.components import recipe_from_dict

BATCH = 8
CAPTIONS = ["a page about red squares", "the yellow star page", "two black lines", "an empty white page",
            "a green triangle on blue", "a table of numbers", "the title page", "a chart with circles"]


@pytest.fixture(scope="module")
def colqwen_raw(tmp_path_factory):
    """Eight (caption query, screenshot document) pairs, the documents of three sizes (1, 4 and 16 image tokens, so
    each rank's and each chunk's documents pad to other lengths), and a ColQwen recipe on them."""
    from PIL import Image

    from vembed.data.tokenizer import train_qwen_tokenizer

    root = tmp_path_factory.mktemp("colqwen")
    (root / "pages").mkdir()
    rows = []
    for i, caption in enumerate(CAPTIONS):
        side = (8, 16, 32)[i % 3] if i < 4 else (32, 16, 32)[i % 3]
        pixels = np.random.default_rng(i).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "pages" / f"{i}.png")
        rows.append({"query": caption, "positive_image": f"pages/{i}.png"})
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    train_qwen_tokenizer(CAPTIONS * 4 + ["Represent the user's input.", "Find the page."], root / "tokenizer",
                         vocab_size=300)
    config = copy.deepcopy(QWEN_BACKBONES["qwen3_vl"])
    config["text_config"]["attention_dropout"] = 0.0
    return {
        "model_type": "qwen_vl", "model_config": {"model_type": "qwen3_vl", **config}, **QWEN_PIXELS,
        "tokenizer_name": str(root / "tokenizer"), "query_instruction": "Find the page.", "train_vision_tower": True,
        "embedding": "multi_vector", "multi_vector_dim": 16, "loss_type": "late_interaction", "temperature": 0.5,
        "learnable_temperature": True, "data": {"train": str(root / "train.jsonl")}, "batch_size": BATCH,
        "output_dir": str(root / "run"), "seed": 0, "eval_before_training": False,
    }


def test_grad_cache_equals_the_whole_batch(colqwen_raw):
    raw = dict(colqwen_raw, use_gradient_cache=True, gradient_cache_chunk_size=3)  # chunks of 3, 3, 2
    rows = list(range(BATCH))
    trainer = _trainer(raw)
    assert trainer.plan.grad_cache.enabled
    cached_loss = trainer.train_step(_batch(trainer, rows)).item()
    cached = _grads(trainer)
    reference, reference_loss = _reference_step(raw, rows, chunk=None)
    assert cached_loss == pytest.approx(reference_loss, rel=1e-5)
    print(f"relative gradient difference: {_assert_close(cached, reference):.2e}")
    assert "adapter.projection.weight" in cached and "loss._infonce.log_scale" in cached
    assert any(".visual." in name for name in cached)  # the image tokens' vectors reached the vision tower


def _rank_steps(raw_path: str, out_dir: str) -> None:
    """This rank's half of the batch, one plain step and one GradCache step (chunks of 3: 3 + 1 rows per side)."""
    import torch.distributed as dist

    raw = json.loads(Path(raw_path).read_text())
    rank, half = dist.get_rank(), BATCH // dist.get_world_size()
    results = {}
    for name, cache in (("plain", {}), ("cached", {"use_gradient_cache": True, "gradient_cache_chunk_size": 3})):
        trainer = _trainer(dict(raw, **cache))
        loss = trainer.train_step(_batch(trainer, list(range(rank * half, (rank + 1) * half))))
        results[name] = {"loss": loss.item(), "grads": _grads(trainer)}
    torch.save(results, Path(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_whole_batch(colqwen_raw, tmp_path):
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(dict(colqwen_raw, batch_size=BATCH // 2, output_dir=str(tmp_path / "run"))))
    run_on_ranks(_rank_steps, str(raw_path), str(tmp_path), world=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    single, single_loss = _reference_step(dict(colqwen_raw, output_dir=str(tmp_path / "single")), list(range(BATCH)),
                                          chunk=None)
    for name in ("plain", "cached"):
        # Each rank's loss is over its own queries (against every rank's documents); their mean is the whole batch's.
        assert np.mean([result[name]["loss"] for result in ranks]) == pytest.approx(single_loss, rel=1e-5), name
        for result in ranks:
            print(f"{name}: relative gradient difference {_assert_close(result[name]['grads'], single):.2e}")


def _page_corpus(path: Path, pages: Path) -> Path:
    """The eight pairs as a corpus folder (a multi_vector model's validation split): caption queries, page images."""
    from vembed.data.corpus import write_corpus_folder

    return write_corpus_folder(path, {f"p{i}": {"image": str(pages / f"{i}.png")} for i in range(8)},
                               {f"q{i}": {"text": CAPTIONS[i]} for i in range(8)},
                               {"dev": {f"q{i}": {f"p{i}": 1} for i in range(8)}})


def test_a_run_saves_a_final_that_gives_the_trained_adapters_token_vectors(colqwen_raw, tmp_path):
    """Two steps with a corpus folder of page images as the validation split (searched by MaxSim in the run), then
    `vembed.load(final)` encodes queries and pages as the adapter that trained did."""
    import vembed
    from vembed.data.records import Side
    from vembed.models.encoding import encode_sides
    from vembed.training.loop import Trainer

    pages = Path(colqwen_raw["data"]["train"]).parent / "pages"
    corpus = _page_corpus(tmp_path / "corpus", pages)
    raw = dict(colqwen_raw, output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=1e-3, batch_size=4,
               data={**colqwen_raw["data"], "validation": str(corpus)})
    trainer = Trainer(recipe_from_dict(raw))
    result = trainer.run()
    assert 0 < result.metrics["validation"]["corpus/ndcg@10"] <= 1
    model = vembed.load(str(result.final_model_dir), device="cpu")
    images = [str(pages / f"{i}.png") for i in range(3)]
    trained = trainer.adapter.cpu().eval()
    for role, kwargs, sides in (
            ("query", {"texts": CAPTIONS[:3]}, [Side(text=text, role="query") for text in CAPTIONS[:3]]),
            ("document", {"images": images}, [Side(image=image, role="document") for image in images])):
        loaded = model.encode_token_vectors(role=role, **kwargs)
        torch.testing.assert_close(loaded, encode_sides(trained, sides).cpu(), atol=1e-6, rtol=0)
    # Asked for one vector per item, it names what it is and the calls that serve it (not "ColBERT" only).
    with pytest.raises(ValueError, match=r"ColQwen\) model: .*encode_token_vectors\(texts, images=\.\.\., role"):
        model.encode(images=images)


# What `accelerate launch --config_file accelerate_configs/fsdp.yaml` sets (the configs' 8B recipe pairs it with LoRA),
# with mixed precision off so that two ranks can equal one process to float32 rounding.
FSDP_LAUNCH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
               "FSDP_OFFLOAD_PARAMS": "false", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
               "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "ACCELERATE_MIXED_PRECISION": "no"}
# configs/colqwen3_vl_8b_fsdp.yaml's training keys at tiny size: LoRA on the language model, the vision tower frozen,
# gradient checkpointing; the projection and the temperature trained fully.
FSDP_LORA = {"use_fsdp": True, "use_lora": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
             "train_vision_tower": False, "gradient_checkpointing": True, "max_steps": 2, "learning_rate": 1e-3,
             "logging_steps": 1}
FSDP_BATCH = 4  # 2 steps: the 8 pairs once


def _trainable(trainer) -> set[str]:
    return {name for name, p in trainer.objective.named_parameters() if p.requires_grad}


def _encoded_sides(pages: Path):
    from vembed.data.records import Side

    return {"query": [Side(text=text, role="query") for text in CAPTIONS[:3]],
            "document": [Side(image=str(pages / f"{i}.png"), role="document") for i in range(3)]}


def _fsdp_lora_run(raw_path: str, out_dir: str) -> None:
    """Two optimizer steps of the run under FSDP2 (evaluated on the page corpus, final/ saved), then the trained
    model's token vectors through the sharded forward evaluation uses, and the gradients of one more batch (2 rows
    per rank) without a step."""
    import os

    import torch.distributed as dist

    from vembed.models.encoding import encode_sides
    from vembed.training.fsdp import full_precision_gathers
    from vembed.training.loop import Trainer
    from vembed.training.sharded_state import gather_full_state_dict

    os.environ.update(FSDP_LAUNCH)
    rank = dist.get_rank()
    raw = json.loads(Path(raw_path).read_text())
    trainer = Trainer(recipe_from_dict(raw))
    result = trainer.run()
    assert trainer.plan.kind == "fsdp" and trainer.plan.uses_lora
    acc = trainer.accelerator
    with torch.no_grad(), full_precision_gathers(trainer.model):
        vectors = {role: encode_sides(trainer.adapter, sides, accelerator=acc,
                                      forward=lambda inputs: trainer.model(encode=inputs))
                   for role, sides in _encoded_sides(Path(raw["data"]["train"]).parent / "pages").items()}
    state = gather_full_state_dict(acc, trainer.objective)  # every rank takes part
    trainer.model.train()
    half = FSDP_BATCH // 2
    trainer.train_step(_batch(trainer, list(range(rank * half, (rank + 1) * half))))
    grads = {name: p.grad.full_tensor() for name, p in trainer.objective.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"losses": [record["loss"] for record in result.state.loss_history], "state": state,
                    "metrics": result.metrics["validation"],
                    "trainable": _trainable(trainer), "vectors": vectors, "grads": grads,
                    "final": str(result.final_model_dir)}, Path(out_dir, "fsdp.pt"))


@pytest.mark.slow
def test_fsdp2_lora_two_ranks_train_as_one_process_and_save_a_final_that_loads(colqwen_raw, tmp_path):
    """ColQwen under FSDP2 + LoRA, the shape of configs/colqwen3_vl_8b_fsdp.yaml (each decoder layer and vision block
    one unit, the token projection in the adapter's unit): two ranks of 2 pairs train as one process on batches of 4
    (losses and trainable weights after 2 AdamW steps, then the gradients of a third batch, which Adam's
    scale-free steps would not show wrong by a factor); the saved final/ gives the sharded model's token vectors."""
    import vembed

    pages = Path(colqwen_raw["data"]["train"]).parent / "pages"
    data = {**colqwen_raw["data"], "validation": str(_page_corpus(tmp_path / "corpus", pages))}
    raw = dict(colqwen_raw, **FSDP_LORA, batch_size=FSDP_BATCH // 2, output_dir=str(tmp_path / "fsdp"), data=data)
    raw_path = tmp_path / "fsdp.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_fsdp_lora_run, str(raw_path), str(tmp_path), world=2)
    got = torch.load(tmp_path / "fsdp.pt", weights_only=True)

    from vembed.training.loop import Trainer

    single_raw = dict(raw, use_fsdp=False, batch_size=FSDP_BATCH, output_dir=str(tmp_path / "single"))
    single = Trainer(recipe_from_dict(single_raw))
    result = single.run()
    assert got["losses"] == pytest.approx([record["loss"] for record in result.state.loss_history], rel=1e-5)
    # In-run evaluation (MaxSim search of the page corpus, each rank a share of the pages) as one process's.
    assert got["metrics"] == pytest.approx(result.metrics["validation"], abs=1e-6)
    trainable = _trainable(single)
    assert got["trainable"] == trainable
    assert "adapter.projection.weight" in trainable and any("lora_A" in name for name in trainable)
    assert not any(".visual." in name for name in trainable)  # the frozen tower, as in the 8B recipe
    weights = single.objective.state_dict()
    for name in sorted(trainable):
        torch.testing.assert_close(got["state"][name], weights[name], rtol=0, atol=1e-5, msg=name)
    print(f"largest trainable weight difference after 2 steps: "
          f"{max((got['state'][n] - weights[n]).abs().max().item() for n in trainable):.2e}")
    assert all(weights[n].abs().max() > 1e-4 for n in trainable if "lora_B" in n)  # zero at the start: they trained
    single.model.train()
    single.train_step(_batch(single, list(range(FSDP_BATCH))))
    print(f"relative gradient difference after 2 steps: {_assert_close(got['grads'], _grads(single)):.2e}")

    model = vembed.load(got["final"], device="cpu")
    loaded = {"query": model.encode_token_vectors(role="query", texts=CAPTIONS[:3]),
              "document": model.encode_token_vectors(role="document", images=[str(pages / f"{i}.png")
                                                                               for i in range(3)])}
    for role, vectors in got["vectors"].items():
        torch.testing.assert_close(loaded[role], vectors.cpu(), rtol=0, atol=1e-5, msg=role)
