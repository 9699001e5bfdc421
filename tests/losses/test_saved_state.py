"""A loss's trained state in final/ (vembed/losses/saved_state.py), for the losses beside ArcFace that have one:
SigLIP's bias and a learnable temperature used to be trained and then dropped from final/. ArcFace's centres, which a
reloaded model scores with, are tested with the metric_learning task (tests/classification/test_metric_learning.py)."""

from __future__ import annotations

import torch
from tiny_models import tiny_clip_run

import vembed
from vembed.components import recipe_from_dict
from vembed.losses.saved_state import LOSS_STATE_FILE
from vembed.training.loop import Trainer


def test_siglip_bias_and_learned_temperature_are_saved_and_reloaded(dummy_data_dir, tmp_path):
    raw = tiny_clip_run(dummy_data_dir, tmp_path / "run", loss_type="siglip", learnable_temperature=True,
                        max_steps=2, save_steps=None)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    trained = {name: value.detach() for name, value in trainer.objective.loss.state_dict().items()}
    built = Trainer(recipe_from_dict(dict(raw, output_dir=str(tmp_path / "unused"))))
    built.build()
    assert all(not torch.equal(built.objective.loss.state_dict()[name], value) for name, value in trained.items())

    final = tmp_path / "run" / "final"
    assert (final / LOSS_STATE_FILE).is_file()
    saved = vembed.load(str(final), device="cpu").loss
    assert saved.loss_type == "siglip" and saved.module is None  # kept as tensors: nothing scores with them
    assert saved.tensors.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(saved.tensors[name], value), name
    assert "`loss.safetensors`; `vembed.load` restores it" in (final / "README.md").read_text()


def test_a_fixed_temperature_loss_saves_nothing_beside_the_model(dummy_data_dir, tmp_path):
    Trainer(recipe_from_dict(tiny_clip_run(dummy_data_dir, tmp_path / "run", max_steps=1, save_steps=None))).run()
    assert not (tmp_path / "run" / "final" / LOSS_STATE_FILE).exists()
    assert vembed.load(str(tmp_path / "run" / "final"), device="cpu").loss is None
