"""The GPU check's `levers` step: what three GPU levers are worth on the lent machine, each measured before it is kept
(bench/gpu_check.py runs `levers(ctx)` in its own process and budget).

- loop checks: the loop's real optimizer step (`Trainer.train_on_batch`: the NaN/Inf check and gradient clipping,
  whose flags are read on the host every step, one synchronisation) against the bare step (forward, backward,
  AdamW) on the same packed MiniLM-shaped batch. The gap is what a step without any host synchronisation could win.
- fused AdamW (vembed's default where every parameter allows it) against torch's foreach AdamW, same batch.
- torch.compile of the towers (`compile: true`) against eager, CLIP ViT-B/32 shapes at batch 256; the compilation
  time is reported apart from the step time (GPU only: on 2 CPU cores compiling even the toy CLIP takes ~2 minutes).

Each is timed as the other steps are (`_timed`: median of synchronised steps after a warm-up), interleaved in rounds.
"""

from __future__ import annotations

import statistics
from typing import Any

LEVERS = {"batch": 256, "warmup": 2, "steps": 5, "rounds": 2, "max_length": 256}
LEVERS_DRY = {"batch": 16, "warmup": 1, "steps": 1, "rounds": 1, "max_length": 64}


def levers(ctx) -> dict[str, Any]:
    import gpu_check as check

    shape = LEVERS_DRY if ctx.dry_run else LEVERS
    result = {"loop_checks": _loop_checks(ctx, check, shape), "fused_adamw": _fused_adamw(ctx, check, shape),
              # compiling takes minutes on 2 CPU cores even at toy size: the dry run leaves it to the GPU
              "compile_clip": "not tried (CPU dry run)" if ctx.dry_run else _compile_clip(ctx, check), "shape": shape}
    result["summary"] = "; ".join(record["summary"] for record in result.values() if isinstance(record, dict)
                                  and "summary" in record)
    return result


def _text_trainers(ctx, check, shape: dict[str, Any], **extra: Any):
    from accelerate.utils import send_to_device

    throughput = check._bench_module("throughput")
    rows = throughput._uneven_rows(shape["batch"] * 2)
    throughput._write_jsonl(ctx.work / "train.jsonl", rows)
    model_dir = check._minilm_folder(ctx, rows)
    raw = {"model_type": "text", "model_name": model_dir, "pooling": "mean", "symmetric_loss": False,
           "data": {"train": str(ctx.work / "train.jsonl"), "num_hard_negatives": 0}, "packing": True,
           "batch_size": shape["batch"], "max_length": shape["max_length"], "learning_rate": 2e-5,
           "mixed_precision": "no" if ctx.dry_run else "bf16", **extra}
    trainer = check._trainer({**raw, "output_dir": str(ctx.work / "run")})
    batch = send_to_device(trainer.collate([trainer.dataset[i] for i in range(shape["batch"])]),
                           trainer.accelerator.device)
    return raw, trainer, batch


def _rounds(ctx, check, shape: dict[str, Any], systems: dict[str, Any]) -> dict[str, float]:
    """Samples/s of each system (a no-argument step), interleaved and rotated per round."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for round_index in range(shape["rounds"]):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            check._timed(systems[name], ctx, shape["warmup"])
            seconds[name].append(check._timed(systems[name], ctx, shape["steps"]))
    return {name: shape["batch"] / statistics.median(s) for name, s in seconds.items()}


def _loop_checks(ctx, check, shape: dict[str, Any]) -> dict[str, Any]:
    from vembed.training.checkpoint import TrainerState

    _, trainer, batch = _text_trainers(ctx, check, shape)
    state = TrainerState()
    rates = _rounds(ctx, check, shape, {
        "loop step (checks, one host sync)": lambda: trainer.train_on_batch(batch, state),
        "bare step": lambda: check._optimizer_step(trainer, batch),
    })
    loop, bare = rates.values()
    return {"samples_per_second": rates, "loop_over_bare": loop / bare,
            "summary": f"loop step {loop:.0f} vs bare step {bare:.0f} samples/s ({loop / bare:.2f}x)"}


def _fused_adamw(ctx, check, shape: dict[str, Any]) -> dict[str, Any]:
    import torch

    raw, fused, batch = _text_trainers(ctx, check, shape)
    inner = fused.optimizer.optimizer  # accelerate's wrapper holds torch's AdamW
    foreach = check._trainer({**raw, "output_dir": str(ctx.work / "foreach")})
    foreach.objective.load_state_dict(fused.objective.state_dict())
    groups = [{key: value for key, value in group.items() if key != "params"} | {"params": list(group["params"])}
              for group in foreach.optimizer.optimizer.param_groups]
    for group in groups:
        group.pop("fused", None)
        group.pop("foreach", None)
    foreach.optimizer.optimizer = torch.optim.AdamW(groups, foreach=True)
    rates = _rounds(ctx, check, shape, {"fused": lambda: check._optimizer_step(fused, batch),
                                        "foreach": lambda: check._optimizer_step(foreach, batch)})
    return {"samples_per_second": rates, "fused_kernel": bool(inner.defaults.get("fused")),
            "fused_over_foreach": rates["fused"] / rates["foreach"],
            "summary": f"fused AdamW {rates['fused']:.0f} vs foreach {rates['foreach']:.0f} samples/s "
                       f"({rates['fused'] / rates['foreach']:.2f}x)"}


def _compile_clip(ctx, check) -> dict[str, Any]:
    import json
    import time

    from accelerate.utils import send_to_device
    from transformers import AutoTokenizer

    from vembed.data.synthetic import make_dummy_dataset
    from vembed.data.tokenizer import special_token_ids

    shape = check.CLIP_DRY if ctx.dry_run else check.CLIP_SHAPES
    config = check.TINY_CLIP_SHAPE if ctx.dry_run else json.loads(
        (check.BENCH / "configs/clip_vit_base_patch32.json").read_text())
    config = json.loads(json.dumps(config))
    tokens = config["text_config"]["max_position_embeddings"]
    data = ctx.work / "clip_data"
    make_dummy_dataset(data, check._samples_for(shape["batch"]), seed=0,
                       image_size=config["vision_config"]["image_size"])
    config["text_config"].update(special_token_ids(AutoTokenizer.from_pretrained(data / "tokenizer")))
    raw = {"model_type": "clip", "model_config": config, "tokenizer_name": str(data / "tokenizer"),
           "data": {"train": str(data / "train.jsonl"), "num_hard_negatives": 0}, "batch_size": shape["batch"],
           "max_length": tokens, "mixed_precision": "no" if ctx.dry_run else "bf16", "learning_rate": 1e-4}
    eager = check._trainer({**raw, "output_dir": str(ctx.work / "eager")})
    compiled = check._trainer({**raw, "compile": True, "output_dir": str(ctx.work / "compiled")})
    compiled.objective.load_state_dict(eager.objective.state_dict(), strict=False)
    side = check._bench_module("planner_accuracy").synthetic_side
    adapter = eager.objective.adapter
    batch = send_to_device({"query": side(adapter, "text", shape["batch"], tokens),
                            "positive": side(adapter, "image", shape["batch"], 0), "num_negatives": 0},
                           eager.accelerator.device)
    start = time.perf_counter()
    check._optimizer_step(compiled, batch)  # the first step compiles
    ctx.sync()
    compile_seconds = time.perf_counter() - start
    rates = _rounds(ctx, check, {**shape, "rounds": 2}, {"eager": lambda: check._optimizer_step(eager, batch),
                                                         "compiled": lambda: check._optimizer_step(compiled, batch)})
    return {"samples_per_second": rates, "compile_seconds": compile_seconds,
            "compiled_over_eager": rates["compiled"] / rates["eager"],
            "summary": f"CLIP compile {rates['compiled']:.0f} vs eager {rates['eager']:.0f} samples/s "
                       f"({rates['compiled'] / rates['eager']:.2f}x, {compile_seconds:.0f} s to compile)"}
