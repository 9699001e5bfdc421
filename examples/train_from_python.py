"""Train, evaluate and use an embedding model from Python instead of the command line.

    python examples/train_from_python.py            # offline: coloured-shape pictures and captions, tiny CLIP

The same `Recipe` keys as in YAML; `Trainer(recipe).run()` is exactly what `vembed/entrypoints/train.py` runs.
Launch this file with `accelerate launch` to train it on several processes.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vembed  # noqa: E402
from vembed.components import recipe_from_dict  # noqa: E402
from vembed.data.synthetic import make_dummy_dataset  # noqa: E402
from vembed.training.loop import Trainer  # noqa: E402

DATA = "runs/example/data"


def main() -> None:
    make_dummy_dataset(DATA, num_samples=600)  # train/validation/test JSONL + images/ + tokenizer/
    recipe = recipe_from_dict(
        {
            "model_type": "clip",
            "tokenizer_name": f"{DATA}/tokenizer",
            "model_config": {
                "projection_dim": 32,
                "text_config": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32,
                                "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3},
                "vision_config": {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 2},
            },
            "data": {"train": f"{DATA}/train.jsonl", "validation": f"{DATA}/validation.jsonl",
                     "test": f"{DATA}/test.jsonl"},
            "output_dir": "runs/example",
            "batch_size": 32,
            "learning_rate": 1e-3,
            "epochs": 10,
            "learnable_temperature": True,
            "save_steps": None,
        }
    )
    trainer = Trainer(recipe)
    try:
        result = trainer.run()
    finally:
        trainer.accelerator.end_training()
    if not trainer.accelerator.is_main_process:
        return
    print("test metrics:", {k: round(v, 3) for k, v in result.metrics["test"].items() if k.startswith("q2d/accuracy")})

    model = vembed.load(str(result.final_model_dir))
    texts = model.encode(texts=["a red circle", "a blue square"])
    print("similarity of the two captions:", float(texts[0] @ texts[1]))


if __name__ == "__main__":
    main()
