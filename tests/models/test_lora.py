"""vembed/models/lora.py on a plain two-layer tower (fast, no Hugging Face model): which layers LoRA wraps and the
errors naming the ones it cannot, the tower's mode kept, the merged state dict equal to the LoRA model, and LoRA
weights alone saved with the rank, alpha and dropout they were built with."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora import LoraLayer  # at the top (lora.py imports PEFT lazily): mutation-test workers fork after it
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D  # noqa: F401  (imported once, as above)

from vembed.errors import RecipeError
from vembed.models.lora import (
    LORA_CONFIG,
    LORA_WEIGHTS,
    inject_lora,
    load_lora_weights,
    merged_state_dict,
    save_lora_weights,
)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


class Tower(nn.Module):
    """Attention projections, an MLP, and a pooling nn.MultiheadAttention whose out_proj LoRA must leave alone."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn, self.mlp, self.pool = Attention(), nn.Linear(4, 4), nn.MultiheadAttention(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn.q_proj(x) + self.attn.k_proj(x) * self.attn.v_proj(x)
        return self.pool(self.mlp(x), x, x, need_weights=False)[0]


def _lora(towers, names=("q_proj", "v_proj"), *, r=2, alpha=6, dropout=0.0, strict=True):
    inject_lora(towers, names, r=r, alpha=alpha, dropout=dropout, strict=strict, model_type="clip")
    with torch.no_grad():  # lora_B starts at zero: give it weight so that LoRA changes the output
        for tower in towers:
            for name, p in tower.named_parameters():
                if "lora_B" in name:
                    p.normal_(generator=torch.Generator().manual_seed(len(name)))


def _wrapped(tower: nn.Module) -> list[str]:
    return sorted(name for name, module in tower.named_modules() if isinstance(module, LoraLayer))


def test_lora_wraps_the_layers_whose_name_ends_with_a_target_and_freezes_the_rest():
    tower = Tower()
    _lora([tower], names=("q_proj", "attn.v_proj"), r=2, alpha=6)
    assert _wrapped(tower) == ["attn.q_proj", "attn.v_proj"]
    trainable = sorted(name for name, p in tower.named_parameters() if p.requires_grad)
    assert trainable == [f"attn.{layer}.lora_{ab}.default.weight" for layer in ("q_proj", "v_proj") for ab in "AB"]
    assert tower.attn.q_proj.lora_A["default"].weight.shape == (2, 4)  # rank r
    assert tower.attn.q_proj.scaling["default"] == pytest.approx(3.0)  # alpha / r


def test_a_target_matches_whole_names_only_and_never_inside_multihead_attention():
    for tower in (Tower(), nn.Sequential(Tower())):  # the hint names layers by their own name, however deep
        with pytest.raises(RecipeError) as info:  # "proj" is no layer's name, only the end of some
            _lora([tower], names=("proj",))
        assert info.value.key == "lora_target_modules"
        assert str(info.value).endswith("['proj'] match no linear layer of this clip model; linear layers here are "
                                        "named: k_proj, mlp, q_proj, v_proj")  # no out_proj: it is in the pooling head
    with pytest.raises(RecipeError, match=r"\['out_proj'\] match no linear layer"):
        _lora([Tower()], names=("out_proj",))


def test_strict_targets_must_all_match_and_defaults_need_only_match_in_every_tower():
    with pytest.raises(RecipeError, match=r"lora_target_modules: \['query'\] match no linear layer of this clip model"):
        _lora([Tower()], names=("q_proj", "query"), strict=True)
    tower = Tower()
    _lora([tower], names=("q_proj", "query"), strict=False)  # defaults: the names a tower has
    assert _wrapped(tower) == ["attn.q_proj"]


def test_a_tower_that_no_target_matches_is_an_error_even_when_not_strict():
    other = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RecipeError) as info:
        _lora([Tower(), other], names=("q_proj",), strict=False)
    assert info.value.key == "lora_target_modules"
    assert "none of ['q_proj'] is a linear layer of the Sequential tower; linear layers here are named: 0, " in str(
        info.value)
    assert _wrapped(Tower()) == []


@pytest.mark.parametrize("training", [False, True])
def test_lora_keeps_the_towers_mode(training):
    tower = Tower().train(training)
    _lora([tower], dropout=0.5)
    assert {module.training for module in tower.modules()} == {training}


def test_the_merged_state_dict_is_a_plain_model_equal_to_the_lora_model_which_it_leaves_alone():
    assert merged_state_dict(Tower()) is None
    tower = Tower().eval()
    _lora([tower])
    before = {name: p.clone() for name, p in tower.state_dict().items()}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tower(x)
    merged = merged_state_dict(tower)
    plain = Tower(seed=1).eval()
    assert sorted(merged) == sorted(plain.state_dict())
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(tower(x), expected, atol=0, rtol=0)
    assert all(torch.equal(p, before[name]) for name, p in tower.state_dict().items())


def test_the_merged_state_dict_keeps_the_weights_dtype():
    tower = Tower().to(torch.bfloat16)
    _lora([tower])
    for module in tower.modules():  # LoRA weights kept in float32 beside bfloat16 base weights (as PEFT may)
        if isinstance(module, LoraLayer):
            module.lora_A.float(), module.lora_B.float()
    assert {value.dtype for value in merged_state_dict(tower).values()} == {torch.bfloat16}


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_weights_alone_are_saved_with_their_config_and_load_back(tmp_path, dropout):
    tower = Tower().eval()
    _lora([tower], r=2, alpha=6, dropout=dropout)
    folder = tmp_path / "run" / "lora"  # its parent is created too
    save_lora_weights(tower, folder)
    save_lora_weights(tower, folder)  # again, into the folder now there (as each save of a run)
    config = json.loads((folder / LORA_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (2, 6, dropout)
    assert sorted(config["target_modules"]) == ["attn.q_proj", "attn.v_proj"]
    assert all(".lora_" in key for key in load_file(str(folder / LORA_WEIGHTS)))
    loaded = Tower().eval()
    load_lora_weights(loaded, folder)
    assert {module.training for module in loaded.modules()} == {False}  # else its LoRA dropout makes it random
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), tower(x), atol=1e-6, rtol=0)


def test_saving_lora_weights_of_a_model_without_lora_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^the model has no LoRA layers to save; save the full model instead$"):
        save_lora_weights(Tower(), tmp_path / "lora")
    assert not (tmp_path / "lora").exists()


@pytest.mark.parametrize("count", [2, 3, 4])
def test_lora_weights_that_do_not_fit_the_base_model_are_a_recipe_error_naming_three_of_each(tmp_path, count):
    tower = Tower()
    _lora([tower], names=("q_proj", "k_proj", "v_proj", "mlp"))
    save_lora_weights(tower, tmp_path / "lora")
    path = str(tmp_path / "lora" / LORA_WEIGHTS)
    weights = load_file(path)
    missing = [key for key in tower.state_dict() if ".lora_" in key][:count]
    unexpected = [f"extra{i}.lora_A.default.weight" for i in range(count)]
    weights = {**{key: value for key, value in weights.items() if key not in missing},
               **{key: torch.zeros(2, 4) for key in unexpected}}
    save_file(weights, path)
    with pytest.raises(RecipeError) as info:
        load_lora_weights(Tower(), tmp_path / "lora")
    assert info.value.key == "model"
    assert str(info.value).endswith(f"LoRA weights in {str(tmp_path / 'lora')!r} do not match the base model "
                                    f"(unexpected {unexpected[:3]}, missing {missing[:3]})")
