"""The metric-learning losses (vembed/classification/metric_losses.py): PML's losses on the global batch. Two gloo ranks
with DDP, each encoding half of a labelled batch, give the loss and the gradients (encoder and ArcFace's centres) of one
process on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from metric_losses import LABELS, OUT, check_two_ranks_equal_one_process, images

pytest.importorskip("pytorch_metric_learning")

CLASSES = 4


def _losses() -> dict:
    from vembed.classification.metric_losses import NTXentLoss, SubCenterArcFaceLoss, SupConLoss

    torch.manual_seed(7)  # ArcFace's centres: the same on every rank and in the single process
    return {"supcon": SupConLoss(temperature=0.1), "ntxent": NTXentLoss(temperature=0.07),
            "subcenter_arcface": SubCenterArcFaceLoss(CLASSES, OUT, margin=28.6, scale=16.0, sub_centers=2)}


@pytest.mark.slow
def test_two_ranks_give_the_loss_and_gradients_of_one_process_on_the_whole_batch(tmp_path):
    ranks = check_two_ranks_equal_one_process(tmp_path, _losses)
    # ArcFace's centres are the loss's own parameter: compared there, and trained (DDP averaged them).
    assert "loss.loss.W" in ranks[0]["subcenter_arcface"]["grads"]


def test_one_process_is_the_library_loss_of_the_batch():
    from pytorch_metric_learning import losses

    embeddings = F.normalize(images()[:, :OUT], dim=-1)
    ours = _losses()
    assert ours["supcon"](embeddings, LABELS) == losses.SupConLoss(temperature=0.1)(embeddings, LABELS)
    assert ours["ntxent"](embeddings, LABELS) == losses.NTXentLoss(temperature=0.07)(embeddings, LABELS)
    arcface = ours["subcenter_arcface"]
    reference = losses.SubCenterArcFaceLoss(num_classes=CLASSES, embedding_size=OUT, margin=28.6, scale=16.0,
                                            sub_centers=2)
    reference.load_state_dict(arcface.loss.state_dict())
    assert arcface(embeddings, LABELS) == reference(embeddings, LABELS)
    assert arcface.loss.W.shape == (OUT, CLASSES * 2)
    assert arcface.config == {"name": "SubCenterArcFaceLoss", "num_classes": CLASSES, "embedding_dim": OUT,
                              "margin": 28.6, "scale": 16.0, "sub_centers": 2}
