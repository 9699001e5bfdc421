"""The generative path: models that turn embeddings into other embeddings (the BLIP3-o DiT: EVA-CLIP patch tokens →
CLIP patch tokens by rectified flow), apart from the embedding adapters.

- `dit.py` the model, chosen by `model_type` through GENERATORS;
- `flow.py` the flow-matching convention and loss, chosen by `loss_type` through FLOW_LOSSES;
- `samplers.py` the ODE samplers that generate with a trained model;
- `task.py` how it is trained and measured (the `flow_matching` task).

The models and losses here take settings from a recipe like the embedding ones (`vembed.components` finds them),
but they encode no text or image: `vembed.load` / `vembed.models.load_adapter` refuse them; `load_generator` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vembed.registry import Registry

GENERATORS: Registry[Any] = Registry("model_type", modules=("vembed.generation.dit",))
FLOW_LOSSES: Registry[Any] = Registry("loss_type", modules=("vembed.generation.flow",))


def load_generator(path: str | Path) -> Any:
    """A generator saved by vembed (`output_dir/final` of a blip3o_dit run)."""
    from vembed.errors import RecipeError
    from vembed.models.base import read_adapter_file

    model_type = read_adapter_file(path).get("model_type")
    if model_type not in GENERATORS:
        raise RecipeError("model", f"{str(path)!r} holds a {model_type!r} model, not a generator; load it with "
                                   "vembed.load(path)")
    return GENERATORS.get(model_type).load(path)


__all__ = ["FLOW_LOSSES", "GENERATORS", "load_generator"]
