"""blip3o_dit: shapes, zero-initialised output, grid rotary positions, GQA, save/load, sizes from the recipe."""

from __future__ import annotations

import json

import pytest
import torch

from vembed.components import recipe_from_dict
from vembed.errors import RecipeError
from vembed.generation import GENERATORS
from vembed.generation.dit import SIZES, Blip3oDiT, DiTBlock, DiTConfig, GridRotary, config_from_recipe
from vembed.models import MODELS

CONFIG = DiTConfig(eva_dim=24, clip_dim=12, num_tokens=16, hidden_size=32, num_layers=2, num_heads=4,
                   num_kv_heads=2, eva_adapter_layers=3, mlp_ratio=2.0)


def _trained_looking(model: Blip3oDiT) -> Blip3oDiT:
    # The zero-initialised layers make the untrained model output exactly 0; perturb every weight so that
    # comparisons between two models test something.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_untrained_model_predicts_zero_velocity_of_the_clip_shape():
    torch.manual_seed(0)
    model = Blip3oDiT(CONFIG)
    out = model(torch.randn(3, 16, 12), torch.rand(3), torch.randn(3, 9, 24))  # EVA token count may differ
    assert out.shape == (3, 16, 12)
    assert torch.count_nonzero(out) == 0


def test_registered_with_the_dit_block_for_fsdp():
    assert GENERATORS.get("blip3o_dit") is Blip3oDiT
    assert "blip3o_dit" not in MODELS  # the registry of embedding adapters holds only embedding adapters
    assert Blip3oDiT.block_classes() == (DiTBlock,)
    assert Blip3oDiT.task == "flow_matching"


def test_attention_uses_fewer_key_value_heads():
    model = Blip3oDiT(CONFIG)
    attn = model.blocks[0].self_attn
    head_dim = 32 // 4
    assert attn.q.out_features == 4 * head_dim
    assert attn.kv.out_features == 2 * 2 * head_dim  # keys and values for 2 kv heads


def test_grid_rotary_scores_depend_only_on_the_grid_offset():
    rotary = GridRotary(head_dim=8, num_tokens=16, theta=100.0)  # a 4×4 grid
    q, k = torch.randn(8), torch.randn(8)
    rotated_q = rotary(q.expand(1, 1, 16, 8))[0, 0]
    rotated_k = rotary(k.expand(1, 1, 16, 8))[0, 0]

    def score(a, b):  # tokens a and b given as (row, col)
        return rotated_q[a[0] * 4 + a[1]] @ rotated_k[b[0] * 4 + b[1]]

    # Same (row, col) offset at different places: same score. Different offsets: different scores.
    assert score((0, 0), (1, 2)).item() == pytest.approx(score((2, 1), (3, 3)).item(), abs=1e-5)
    assert score((0, 0), (1, 2)).item() != pytest.approx(score((0, 0), (2, 1)).item(), abs=1e-3)
    assert torch.allclose(rotated_q.norm(dim=-1), q.norm().expand(16))  # rotations keep lengths


def test_save_and_load_give_the_same_velocities(tmp_path):
    torch.manual_seed(0)
    model = _trained_looking(Blip3oDiT(CONFIG)).eval()
    model.save(tmp_path / "dit")
    assert json.loads((tmp_path / "dit" / "vembed.json").read_text())["model_type"] == "blip3o_dit"
    from vembed.generation import load_generator
    from vembed.models import load_adapter

    loaded = load_generator(tmp_path / "dit").eval()
    with pytest.raises(RecipeError, match="not an embedding model.*load_generator"):
        load_adapter(tmp_path / "dit")  # vembed.load encodes texts and images; a DiT does not
    args = (torch.randn(2, 16, 12), torch.rand(2), torch.randn(2, 16, 24))
    assert torch.equal(model(*args), loaded(*args))


def test_generation_is_deterministic_given_a_seed_and_differs_across_seeds():
    torch.manual_seed(0)
    model = _trained_looking(Blip3oDiT(CONFIG)).eval()
    eva = torch.randn(2, 16, 24)
    first = model.generate(eva, sampler="heun", num_steps=3, seed=5)
    assert torch.equal(first, model.generate(eva, sampler="heun", num_steps=3, seed=5))
    assert not torch.equal(first, model.generate(eva, sampler="heun", num_steps=3, seed=6))
    assert first.shape == (2, 16, 12)


INDEX = {"eva_shape": [16, 24], "clip_shape": [16, 12], "path": "shards/index.json"}


def dit_recipe(dit: dict):
    return recipe_from_dict({"model_type": "blip3o_dit", "loss_type": "flow_matching", "dit": dit})


@pytest.mark.parametrize("size", list(SIZES))
def test_size_presets_set_width_depth_and_heads(size):
    config = config_from_recipe(dit_recipe({"size": size}), INDEX)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == SIZES[size]
    assert (config.eva_dim, config.clip_dim, config.num_tokens) == (24, 12, 16)


def test_explicit_dims_override_the_size():
    config = config_from_recipe(dit_recipe({"size": "tiny", "hidden_size": 64, "num_heads": 4,
                                                          "num_kv_heads": 1}), INDEX)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (64, 6, 4, 1)


def test_dims_that_disagree_with_the_shards_name_the_key_and_the_file():
    with pytest.raises(RecipeError) as info:
        config_from_recipe(dit_recipe({"eva_dim": 4096}), INDEX)
    message = str(info.value)
    assert "dit.eva_dim" in message and "shards/index.json" in message and "24" in message
    assert len(message.splitlines()) == 1


# --- what the planner reads (vembed/planning.py) --------------------------------------------------------------------
def _saved_elements(model: Blip3oDiT, *, autocast: bool, cosine: float, samples: int = 2) -> tuple[float, float]:
    """Independent reference: the (fp32, 16-bit) elements per sample autograd saves for backward in a forward and the
    flow-matching loss on CPU (saved-tensor hooks, storages counted once; weights and autocast's weight copies out)."""
    from vembed.generation.flow import FlowMatchingLoss, interpolate

    parameters = {id(p) for p in model.parameters()}
    constants = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, tuple[int, torch.dtype]] = {}

    def weight_copy(tensor: torch.Tensor) -> bool:
        node = (tensor._base if tensor._base is not None else tensor).grad_fn
        if node is None or node.name() != "ToCopyBackward0":
            return False
        source = node.next_functions[0][0]
        return id(getattr(source, "variable", None)) in parameters

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in constants and not weight_copy(tensor):
            storages[storage.data_ptr()] = (storage.nbytes(), tensor.dtype)
        return tensor

    c = model.config
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(samples, c.num_tokens, c.clip_dim, generator=generator)
    noise = torch.randn(samples, c.num_tokens, c.clip_dim, generator=generator)
    eva = torch.randn(samples, c.eva_tokens or c.num_tokens, c.eva_dim, generator=generator)
    t = torch.rand(samples, generator=generator)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        FlowMatchingLoss(cosine)(model(interpolate(noise, data, t), t, eva), noise, data, t)
    wide = sum(n for n, dtype in storages.values() if dtype == torch.float32) / 4 / samples
    narrow = sum(n for n, dtype in storages.values() if dtype == torch.bfloat16) / 2 / samples
    return wide, narrow


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("config", [
    CONFIG,
    DiTConfig(eva_dim=48, clip_dim=24, num_tokens=16, eva_tokens=9, hidden_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, mlp_ratio=2.0, eva_adapter_layers=1),
    DiTConfig(eva_dim=64, clip_dim=64, num_tokens=25, eva_tokens=36, hidden_size=64, num_layers=3, num_heads=4,
              num_kv_heads=4, eva_adapter_layers=2),
], ids=["gqa-adapter3", "fewer-eva-tokens", "no-gqa-identity-adapter"])
def test_activation_count_matches_the_tensors_autograd_keeps(config, autocast):
    torch.manual_seed(0)
    model = Blip3oDiT(config).train()
    for cosine in (0.0, 0.1):
        wide, narrow = _saved_elements(model, autocast=autocast, cosine=cosine)
        counted_wide, counted_narrow = model.activation_elements(autocast=autocast, cosine_loss=cosine > 0)
        assert counted_wide == pytest.approx(wide, rel=0.06) and counted_narrow == pytest.approx(narrow, rel=0.02)
        assert 4 * counted_wide + 2 * counted_narrow == pytest.approx(4 * wide + 2 * narrow, rel=0.03)


def test_on_meta_takes_shapes_from_the_recipe_without_shards_or_names_the_missing_key(tmp_path):
    stated = {"model_type": "blip3o_dit", "loss_type": "flow_matching", "data": {"train": str(tmp_path / "none")},
              "dit": {"size": "tiny", "eva_dim": 24, "clip_dim": 12, "num_tokens": 16}}
    model = Blip3oDiT.on_meta(recipe_from_dict(stated))
    assert all(p.is_meta for p in model.parameters())
    assert (model.config.eva_dim, model.config.clip_dim, model.config.num_tokens) == (24, 12, 16)
    real = Blip3oDiT(model.config)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in real.parameters())
    with pytest.raises(RecipeError, match="needed to plan without shards") as info:
        Blip3oDiT.on_meta(recipe_from_dict({**stated, "dit": {"size": "tiny", "eva_dim": 24}}))
    assert info.value.key == "dit.clip_dim"
