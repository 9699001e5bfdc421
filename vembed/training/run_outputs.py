"""What a run leaves in output_dir besides checkpoints (run_dir.py's RUN_OUTPUTS lists them): final/ (the trained
weights, then the model card that reports the run), metrics.json and the plots.

The loop decides when (the weights first: an evaluation that fails must not cost them); this module how each is
written: every write goes through `writing_checkpoint_files`, so a full disk is one line naming the last checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.errors import TrainingError
from vembed.files import write_json_atomic
from vembed.training.checkpoint import writing_checkpoint_files

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from vembed.recipe import Recipe
    from vembed.tasks import Task

METRICS_FILE = "metrics.json"
FINAL_DIR = "final"


def read_metrics(output_dir: Path) -> dict[str, Any]:
    """metrics.json as a resumed run continues it (the untrained model's "before"), or {}."""
    path = output_dir / METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_metrics_before_training(output_dir: Path, metrics: dict[str, Any]) -> None:
    """metrics.json with the untrained model's evaluation: kept across a resume. Main process only."""
    with writing_checkpoint_files(METRICS_FILE, output_dir, None):
        write_json_atomic(output_dir / METRICS_FILE, metrics)


def save_final_model(accelerator: "Accelerator", output_dir: Path, adapter: Any, recipe: "Recipe",
                     full_state: "dict[str, torch.Tensor] | None", last_good: Path | None,
                     loss: "torch.nn.Module | None" = None) -> Path:
    """final/: the full weights, written under a temporary name and renamed. `full_state`: the objective's state dict
    gathered by every rank together when the run was sharded (rank 0 alone would wait forever), else None and
    `adapter` is saved as it is. A `loss` with trainable state of its own (ArcFace's centres) is saved beside the
    model (vembed/losses/saved_state.py). Every rank calls it; the main process writes."""
    from vembed.losses.saved_state import has_trainable_state, loss_tensors, save_loss_state
    from vembed.training.deepspeed import unsharded_construction

    final_dir = output_dir / FINAL_DIR
    keeps_state = loss is not None and has_trainable_state(loss)
    # Every rank reads the loss's config: a sharded (FSDP2) temperature is gathered by a collective to be read, so
    # rank 0 reading it alone would wait forever for the others.
    loss_config = getattr(loss, "config", {}) if keeps_state else None
    if accelerator.is_main_process:
        tmp = output_dir / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        if full_state is not None:
            with unsharded_construction(accelerator):
                adapter = adapter_with_weights(recipe, full_state)
        with writing_checkpoint_files("the final model", output_dir, last_good, tmp):
            adapter.save(tmp)
            if keeps_state:
                save_loss_state(tmp, loss, recipe.loss_type, loss_tensors(loss, full_state), config=loss_config)
        shutil.rmtree(final_dir, ignore_errors=True)
        tmp.rename(final_dir)
    accelerator.wait_for_everyone()
    return final_dir


def adapter_with_weights(recipe: "Recipe", objective_state: "dict[str, torch.Tensor]"):
    """A single-device copy of the trained adapter, from the gathered state dict of a sharded objective."""
    from vembed.components import model_class

    adapter = model_class(recipe).from_recipe(recipe)
    if recipe.use_lora:
        adapter.apply_lora(recipe)
    prefix = "adapter."
    weights = {k[len(prefix):]: v for k, v in objective_state.items() if k.startswith(prefix)}
    missing, unexpected = adapter.load_state_dict(weights, strict=False)
    # Non-persistent buffers are not in any state dict; everything else must be.
    buffers = {name for name, _ in adapter.named_buffers()}
    missing = [k for k in missing if k not in buffers]
    if missing or unexpected:
        raise TrainingError(
            f"the gathered weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return adapter


def write_end_of_run(output_dir: Path, final_dir: Path, metrics: dict[str, Any], *, recipe: "Recipe", task: "Task",
                     train_data: dict[str, Any], launch: dict[str, Any], last_good: Path | None,
                     warn=print) -> None:
    """metrics.json and the plots into output_dir, then the model card (with the plots) into final/. Main process
    only; final/ holds the weights already."""
    with writing_checkpoint_files("metrics.json and plots", output_dir, last_good):
        write_json_atomic(output_dir / METRICS_FILE, metrics)
        plots = write_plots(output_dir, metrics, task)
    with writing_checkpoint_files("the model card", output_dir, last_good):
        write_model_card(final_dir, output_dir, metrics, plots, recipe=recipe, task=task, train_data=train_data,
                         launch=launch, warn=warn)


def write_plots(output_dir: Path, metrics: dict[str, Any], task: "Task") -> list[Path]:
    """loss_curve.png and the task's own plots; the paths written."""
    from vembed.evaluation.plots import plot_loss_curve

    loss_curve = plot_loss_curve(metrics["loss_history"], output_dir / "loss_curve.png", metrics["eval_history"])
    return [path for path in (loss_curve, *task.plots(metrics, output_dir)) if path is not None]


def loss_state_facts(final_dir: Path) -> dict[str, Any] | None:
    """What the card says of the loss state saved beside the weights (None: there is none)."""
    from vembed.classification import load_saved_loss
    from vembed.losses.saved_state import LOSS_STATE_FILE

    saved = load_saved_loss(final_dir)
    if saved is None:
        return None
    return {"file": LOSS_STATE_FILE, "loss": saved.config.get("name", saved.loss_type),
            "class_scores": saved.module is not None and hasattr(saved.module, "class_scores"),
            "classes": len(saved.class_names) if saved.class_names else None}


def write_model_card(final_dir: Path, output_dir: Path, metrics: dict[str, Any], plots: list[Path], *,
                     recipe: "Recipe", task: "Task", train_data: dict[str, Any], launch: dict[str, Any],
                     warn=print) -> None:
    """README.md and card.json (what the card was built from, so `vembed export` and later renderings need
    only the model folder) and the run's plots, into final/ (each file written whole, then renamed)."""
    from vembed.model_card import build_card, remove_card, write_card
    from vembed.models.base import read_adapter_file

    data = {"train": train_data, **{split: task.split_report(split) for split in ("validation", "test")}}
    try:
        card = build_card(recipe.to_dict(), adapter_info=read_adapter_file(final_dir), launch=launch,
                          data={split: report for split, report in data.items() if report},
                          metrics=metrics, plots=[path.name for path in plots])
        card["model"]["loss_state"] = loss_state_facts(final_dir)
        write_card(final_dir, card, plots_from=output_dir, load_path=str(final_dir))
    except OSError:
        raise  # a full disk: writing_checkpoint_files reports it, as for the weights
    except Exception as error:  # noqa: BLE001 - a card that cannot be rendered must not cost the trained model
        remove_card(final_dir)
        warn(f"warning: final/ has no model card: {type(error).__name__}: {error}")
