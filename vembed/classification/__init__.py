"""Image-label kinds: images with a class each, trained to name the class (classification) or to embed images of one
class near each other (metric learning). Both read the same labelled files; their losses take class ids, not pairs.

- `labelled.py` the labelled images (ImageFolder trees, CSV/JSONL lists, `datasets` tables) and `augment.py` the
  training-image augmentation (crops, flips, TrivialAugment, erasing, mixup/cutmix), drawn per (seed, epoch, sample);
- `losses.py` losses on class logits (`cross_entropy`), chosen by `loss_type` through CLASSIFICATION_LOSSES;
- `metric_losses.py` pytorch-metric-learning's SupCon, NT-Xent and sub-center ArcFace on the global batch, and `pml.py`
  any PML loss and miner by name, chosen by `loss_type` through METRIC_LOSSES;
- `evaluation.py` accuracy, the per-class report, confusion matrix and calibration; `metric_evaluation.py` recall@k
  and MAP@R of labelled embeddings;
- `task.py` the `classification` task and `metric_task.py` the `metric_learning` task;
- `load_saved_loss` (here) a saved model's loss state, with a metric-learning loss rebuilt around it (ArcFace's
  centres score classes when the model is loaded).

The model both train is the shared vision adapter (vembed/models/vision.py, in MODELS). The losses have registries
of their own, as the other wings' do: they take class logits or labelled embeddings, not the embedding pairs of LOSSES.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vembed.registry import Registry

if TYPE_CHECKING:
    from vembed.losses.saved_state import SavedLoss

# Losses on class logits (the classification task): they take no embeddings and no Matryoshka wrapper.
CLASSIFICATION_LOSSES: Registry = Registry("loss_type", modules=("vembed.classification.losses",))
# Losses on labelled embeddings computed by pytorch-metric-learning (the metric_learning task): their own contract,
# embeddings and class ids, and their own parameters (ArcFace's centres).
METRIC_LOSSES: Registry = Registry("loss_type", modules=("vembed.classification.metric_losses",
                                                         "vembed.classification.pml"))



def load_saved_loss(folder: str | os.PathLike) -> "SavedLoss | None":
    """The loss state saved beside a model (`loss.safetensors`, vembed/losses/saved_state.py), or None. A
    metric-learning loss comes back rebuilt from its settings around its trained state (`module`: sub-center ArcFace's
    centres, which the loaded model scores classes with); any other loss's state stays tensors. Here because
    METRIC_LOSSES, which says which losses rebuild, is this wing's."""
    from vembed.losses.saved_state import read_saved_loss

    saved = read_saved_loss(folder)
    if saved is None or saved.loss_type not in METRIC_LOSSES:
        return saved
    loss = METRIC_LOSSES.get(saved.loss_type)(**saved.settings)
    loss.load_state_dict(saved.tensors)
    saved.module = loss.eval()
    return saved


__all__ = ["CLASSIFICATION_LOSSES", "METRIC_LOSSES", "load_saved_loss"]
