"""A loss's trained state in a saved model folder (final/): `loss.safetensors`, written when the loss has parameters of
its own that training moves (sub-center ArcFace's class centres, a learnable temperature, SigLIP's bias), with the
loss's name, settings and class names in its metadata, so that `vembed.load` gives them back with the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

LOSS_STATE_FILE = "loss.safetensors"
_PREFIX = "loss."  # the loss's keys in the objective's state dict (objective.loss)


def has_trainable_state(loss: nn.Module) -> bool:
    """Whether training moves some of the loss's own tensors: then the model is incomplete without them."""
    return any(parameter.requires_grad for parameter in loss.parameters())


def loss_tensors(loss: nn.Module, objective_state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The loss's state dict, from the loss itself or (a sharded run) from the objective's gathered state dict."""
    if objective_state is not None:
        return {key[len(_PREFIX):]: value for key, value in objective_state.items() if key.startswith(_PREFIX)}
    return loss.state_dict()


def save_loss_state(folder: str | Path, loss: nn.Module, loss_type: str, tensors: dict[str, torch.Tensor],
                    config: dict[str, Any] | None = None) -> Path:
    """`loss.safetensors` in `folder`: the tensors, and in its metadata what rebuilds the loss around them. `config`:
    the loss's config as every rank read it (a sharded run), else read here."""
    from safetensors.torch import save_file

    config = getattr(loss, "config", {}) if config is None else config
    metadata = {"loss_type": loss_type, "config": json.dumps(config),
                "settings": json.dumps(getattr(loss, "settings", {})),
                "class_names": json.dumps(getattr(loss, "class_names", None))}
    path = Path(folder, LOSS_STATE_FILE)
    save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()}, str(path), metadata=metadata)
    return path


@dataclass
class SavedLoss:
    """What `loss.safetensors` holds. `module`: the loss rebuilt with its trained state where the loss's owner
    rebuilds it (metric-learning losses, from `settings`: `vembed.classification.load_saved_loss`), else None and
    `tensors` are the state as saved."""

    loss_type: str
    config: dict[str, Any]
    class_names: list[str] | None
    tensors: dict[str, torch.Tensor]
    settings: dict[str, Any]  # the loss's constructor arguments, as saved
    module: nn.Module | None = None


def read_saved_loss(folder: str | Path) -> SavedLoss | None:
    """The loss state saved in `folder` (tensors and metadata; no module), or None when the model was saved without
    one."""
    from safetensors import safe_open

    path = Path(folder, LOSS_STATE_FILE)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    return SavedLoss(metadata.get("loss_type", ""), json.loads(metadata.get("config", "{}")),
                     json.loads(metadata.get("class_names", "null")), tensors,
                     settings=json.loads(metadata.get("settings", "{}")))
