"""How close is `vembed plan` to the memory a real training step takes? (a bench, not a test: minutes on 2 cores)

For each model × batch × gradient checkpointing, a fresh process builds the recipe's adapter (random init, fp32, one
process, CPU), its loss and AdamW exactly as the training loop does, and runs two steps (forward, loss, backward,
optimizer step, zero_grad). Memory is the process's resident set (Linux /proc/self/status), with glibc told to
serve every allocation above 64 KiB by mmap (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set at
once and it follows live tensor memory:
- parameters  = RSS after building the model − RSS before;
- optimizer   = RSS after step 1 (activations and gradients freed, AdamW moments created) − RSS after building;
- grads+acts  = peak RSS during step 2 (VmHWM, reset through /proc/self/clear_refs) − RSS after step 1
                (estimated as max(activations, gradients), see vembed/planning.py);
- total       = peak RSS during step 2 − RSS before building.
The estimate is the planner's "single" row for the same recipe (fp32).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python bench/planner_accuracy.py [--quick]

prints a Markdown table (copied to docs/benchmarks.md, "Memory planner accuracy").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # for process_memory, however this file is loaded
from process_memory import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

MIB = 1024**2

BERT_20M = {"model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
            "intermediate_size": 1536, "vocab_size": 30522, "max_position_embeddings": 512}  # MiniLM-L6 shape, 22.7M
BERT_100M = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 512}  # BERT-base, 109M
TINY_CLIP = {
    "projection_dim": 64,
    "text_config": {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "max_position_embeddings": 64},
    "vision_config": {"image_size": 64, "patch_size": 8, "hidden_size": 128, "intermediate_size": 512,
                      "num_hidden_layers": 2, "num_attention_heads": 4},
}

CASES = [  # (name, recipe keys, batch sizes)
    ("tiny CLIP (text 64 tok, image 65 patches)", {"model_type": "clip", "model_config": TINY_CLIP, "max_length": 64},
     [64]),
    ("BERT 6×384 (22.7M), 128 tok", {"model_type": "text", "model_config": BERT_20M, "max_length": 128}, [16, 64]),
    ("BERT-base 12×768 (109M), 64 tok", {"model_type": "text", "model_config": BERT_100M, "max_length": 64},
     [8, 32]),
]
QUICK = [CASES[0], (CASES[1][0], CASES[1][1], [16])]


def _recipe(keys: dict, batch_size: int, checkpointing: bool):
    from vembed.components import recipe_from_dict

    return recipe_from_dict({**keys, "tokenizer_name": "unused", "batch_size": batch_size,
                             "gradient_checkpointing": checkpointing, "mixed_precision": "no"})


# --- the measured side: one fresh process per case ------------------------------------------------------------------
def synthetic_side(adapter, modality: str, n: int, tokens: int):
    """One side of `n` rows in the collated layout: `tokens` random token ids (text) or random pixels (image)."""
    import torch

    from vembed.models.batch import IMAGE_INDEX, PIXEL_VALUES, TEXT_INDEX

    rows, none = torch.arange(n), torch.full((n,), -1)
    if modality == "text":
        vocab = adapter.encoder_configs()["text"].vocab_size
        mask = torch.ones(n, tokens, dtype=torch.long)
        mask[0, -1] = 0  # batches are padded to their longest text, so some row always has padding
        return {"input_ids": torch.randint(4, vocab, (n, tokens)), "attention_mask": mask,
                TEXT_INDEX: rows, IMAGE_INDEX: none}
    size = adapter.encoder_configs()["image"].image_size
    return {PIXEL_VALUES: torch.randn(n, 3, size, size), TEXT_INDEX: none, IMAGE_INDEX: rows}


def measure(keys: dict, batch_size: int, checkpointing: bool) -> dict[str, int]:
    """Run in the child: two real training steps; the components in bytes."""
    import torch

    from vembed.components import model_class
    from vembed.losses import build_loss
    from vembed.planning import measure_model, workload_for
    from vembed.tasks.contrastive import ContrastiveObjective
    from vembed.training.objective import parameter_groups

    torch.set_num_threads(2)
    recipe = _recipe(keys, batch_size, checkpointing)
    work = workload_for(recipe, measure_model(recipe), gpus=1)
    query = "text" if "text" in work.sides else "image"  # as the planner assigns sides (workload_for)
    documents = "image" if "image" in work.sides else "text"
    before = rss_bytes()
    adapter = model_class(recipe).on_meta(recipe).to_empty(device="cpu")
    with torch.no_grad():
        for parameter in adapter.parameters():
            parameter.normal_(0, 0.02)
        for buffer_name, buffer in adapter.named_buffers():  # position ids, token type ids: real values
            if "position_ids" in buffer_name:
                buffer.copy_(torch.arange(buffer.shape[-1]).expand_as(buffer))
            else:
                buffer.zero_()
    if recipe.gradient_checkpointing:
        adapter.enable_gradient_checkpointing()
    objective = ContrastiveObjective(adapter, build_loss(recipe)).train()
    optimizer = torch.optim.AdamW(parameter_groups(objective, recipe.weight_decay), lr=1e-5)
    tokens = {m: e.tokens for m, e in measure_model(recipe).encoders.items()}
    batch = {"query": synthetic_side(adapter, query, batch_size, tokens.get(query, 0)),
             "positive": synthetic_side(adapter, documents, batch_size, tokens.get(documents, 0)), "num_negatives": 0}
    built = rss_bytes()

    def step() -> None:
        loss = objective(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    after_first = rss_bytes()
    reset_peak_rss()
    step()
    peak = peak_rss_bytes()
    return {"parameters": built - before, "optimizer": after_first - built, "grads_acts": peak - after_first,
            "total": peak - before}


def _child(spec: str) -> None:
    keys, batch_size, checkpointing = json.loads(spec)
    print(json.dumps(measure(keys, batch_size, checkpointing)))


def _measure_in_fresh_process(keys: dict, batch_size: int, checkpointing: bool) -> dict[str, int]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    spec = json.dumps([keys, batch_size, checkpointing])
    out = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True,
                         check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the estimated side ---------------------------------------------------------------------------------------------
def estimated(keys: dict, batch_size: int, checkpointing: bool) -> dict[str, float]:
    from vembed.planning import STRATEGY_BY_NAME, estimate, measure_model, workload_for

    recipe = _recipe(keys, batch_size, checkpointing)
    model = measure_model(recipe)
    e = estimate(STRATEGY_BY_NAME["single"], model, workload_for(recipe, model, 1, device="cpu"), lora=False)
    total = e.total(checkpointing)
    return {"parameters": e.parameters, "optimizer": e.optimizer,
            "grads_acts": total - e.parameters - e.optimizer, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small cases only")
    parser.add_argument("--cache", help="JSON file of measurements kept between runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    cache = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).is_file() else {}
    print("| model | batch | ckpt | params est/meas MiB | optimizer est/meas MiB | grads+acts est/meas MiB "
          "| total est/meas MiB | total error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, keys, batches in QUICK if args.quick else CASES:
        for batch_size in batches:
            for checkpointing in (False, True):
                est = estimated(keys, batch_size, checkpointing)
                key = json.dumps([keys, batch_size, checkpointing], sort_keys=True)
                if key not in cache:
                    cache[key] = _measure_in_fresh_process(keys, batch_size, checkpointing)
                    if args.cache:
                        Path(args.cache).write_text(json.dumps(cache, indent=1))
                meas = cache[key]
                cells = [f"{est[k] / MIB:.0f} / {meas[k] / MIB:.0f}"
                         for k in ("parameters", "optimizer", "grads_acts", "total")]
                error = (est["total"] - meas["total"]) / meas["total"]
                print(f"| {name} | {batch_size} | {'on' if checkpointing else 'off'} | " + " | ".join(cells)
                      + f" | {error:+.0%} |", flush=True)


if __name__ == "__main__":
    main()
