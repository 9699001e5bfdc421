"""Shipped recipes unchanged in behaviour: the demo recipe trained by another commit's code (default: main) and by
this working tree gives the same weights, bit for bit.

    python bench/same_weights.py [--ref main] [--epochs 2] [--out bench/results/same_weights.json]

Both runs use the same data (scikit-learn's digits, made once by this tree's `make_digits_dataset`), the shipped
`configs/demo_clip.yaml` with the same overrides, one process on CPU, and this venv's packages; only the vembed code
differs (the ref's tree is `git archive`d to a temporary folder and put first on PYTHONPATH). Every tensor of
final/model.safetensors must be equal to the last bit (safetensors' metadata may differ, so tensors are compared).
Exit status 1 when any differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree_of(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    tar = into / "tree.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as handle:
        handle.extractall(into / "tree", filter="data")
    return into / "tree"


def _train(code: Path, data: Path, out: Path, epochs: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    overrides = [f"data.train={data}/train.jsonl", f"data.validation={data}/validation.jsonl",
                 f"data.test={data}/test.jsonl", f"tokenizer_name={data}/tokenizer", f"output_dir={out}",
                 f"epochs={epochs}", "report_to=none", "eval_before_training=false", "save_steps=null"]
    subprocess.run([sys.executable, "-m", "vembed.entrypoints.train", str(ROOT / "configs" / "demo_clip.yaml"),
                    "--config_override", *overrides], check=True, env=env, cwd=out.parent)


def tensor_hashes(model_dir: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    tensors = load_file(model_dir / "model.safetensors")
    return {name: hashlib.sha256(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
            .hexdigest() for name, t in sorted(tensors.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="main", help="the commit whose code trains the reference")
    parser.add_argument("--epochs", type=int, default=2, help="demo epochs (the recipe's 30 take minutes per run)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "same_weights.json"))
    args = parser.parse_args()

    from vembed.data.synthetic import make_digits_dataset

    with tempfile.TemporaryDirectory(prefix="vembed-same-weights-") as tmp:
        work = Path(tmp)
        make_digits_dataset(work / "data")
        runs = {args.ref: _tree_of(args.ref, work), "this tree": ROOT}
        hashes = {}
        for name, code in runs.items():
            out = work / f"run-{len(hashes)}"
            _train(code, work / "data", out, args.epochs)
            hashes[name] = tensor_hashes(out / "final")
    ref, ours = hashes[args.ref], hashes["this tree"]
    differing = sorted(n for n in ref.keys() | ours.keys() if ref.get(n) != ours.get(n))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    ref_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.ref], capture_output=True,
                                text=True).stdout.strip()
    everything = hashlib.sha256(json.dumps(ours, sort_keys=True).encode()).hexdigest()
    result = {"recipe": "configs/demo_clip.yaml", "epochs": args.epochs, "ref": args.ref, "ref_commit": ref_commit,
              "tree_commit": head, "tensors": len(ours), "differing": differing, "weights_sha256": everything}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
