"""BLIP3-o style diffusion transformer: predicts the flow velocity of CLIP patch tokens given EVA-CLIP patch tokens.

Not a retrieval adapter: it maps (noisy CLIP tokens, time, EVA tokens) → velocity, and `generate` turns EVA tokens
into CLIP tokens with a sampler from `vembed.generation.samplers`. Saved as `model.safetensors` + `config.json` +
`vembed.json` (the file every vembed model folder has); `vembed.generation.load_generator` loads it.

Architecture (following the seed): an EVA adapter (gated residual blocks, EVA dim → hidden), an input projection of the
noisy CLIP tokens, a sinusoidal timestep embedding + MLP, then DiT blocks of
  self-attention (grouped-query, 2-D rotary positions over the token grid) → cross-attention to the adapted EVA tokens
  → SwiGLU MLP, each with sandwich RMSNorm (before and after), AdaLN shift/scale/gate from the timestep and a
  learnable layer scale; a zero-initialised output projection to the CLIP dim.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vembed.errors import RecipeError
from vembed.generation import GENERATORS
from vembed.models.base import ADAPTER_FILE
from vembed.recipe import Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe

class DiTSection(Settings):
    """`dit:` the BLIP3-o diffusion transformer (model_type: blip3o_dit). Token shapes come from the shards; any
    stated here must match them."""

    size: Literal["tiny", "small", "base", "large"] | None = "base"  # hidden/layers/heads preset; explicit keys win
    hidden_size: int | None = Field(default=None, gt=0)  # unset: from size (tiny 384, small 512, base 768, large 1024)
    num_layers: int | None = Field(default=None, gt=0)  # DiT blocks (unset: from size: 6, 8, 12, 20)
    num_heads: int | None = Field(default=None, gt=0)  # attention heads (unset: from size)
    num_kv_heads: int | None = Field(default=None, gt=0)  # key/value heads of grouped-query attention (unset: size)
    mlp_ratio: float = Field(default=4.0, gt=0)  # SwiGLU width = hidden_size * mlp_ratio * 2/3
    eva_adapter_layers: int = Field(default=6, gt=0)  # blocks taking the EVA dim down to hidden_size
    layer_scale_init: float = Field(default=0.1, gt=0)  # initial per-channel scale of every residual branch
    rope_theta: float = Field(default=10000.0, gt=0)  # rotary base of the 2-D token-grid positions
    eva_dim: int | None = Field(default=None, gt=0)  # checked against the shards (unset: taken from them)
    clip_dim: int | None = Field(default=None, gt=0)  # checked against the shards (unset: taken from them)
    num_tokens: int | None = Field(default=None, gt=0)  # CLIP tokens per image; checked against the shards


class DiTSettings(Settings):
    dit: DiTSection = Field(default_factory=DiTSection)  # the DiT's sizes; see DiTSection


WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# name → (hidden size, layers, attention heads, key/value heads); the seed's sizes, with GQA groups of 2-4 heads.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (384, 6, 6, 2),
    "small": (512, 8, 8, 4),
    "base": (768, 12, 12, 4),
    "large": (1024, 20, 16, 4),
}


@dataclass
class DiTConfig:
    eva_dim: int  # width of the conditioning (EVA) tokens
    clip_dim: int  # width of the generated (CLIP) tokens
    num_tokens: int  # CLIP tokens per image (a square number gets 2-D rotary positions)
    eva_tokens: int | None = None  # EVA tokens per image (unset: num_tokens)
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    mlp_ratio: float = 4.0
    eva_adapter_layers: int = 6
    layer_scale_init: float = 0.1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    data_scale: float = 1.0  # fixed scale the data is multiplied by before the flow (never data statistics)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 4:
            raise ValueError("the head dimension must be a multiple of 4 (2-D rotary positions)")


# --- building blocks ------------------------------------------------------------------------------------------------


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _grid_positions(num_tokens: int, side: float | None = None) -> torch.Tensor:
    """(N, 2) row/column of each token on a square grid, rescaled to a grid of `side` tokens per row (so an EVA
    grid and a CLIP grid of different resolutions share coordinates); a non-square count is laid out as one row."""
    own = math.isqrt(num_tokens)
    if own * own != num_tokens:
        return torch.stack([torch.zeros(num_tokens), torch.arange(num_tokens).float()], dim=-1)
    idx = torch.arange(num_tokens)
    pos = torch.stack([idx // own, idx % own], dim=-1).float()
    return pos * (side / own) if side else pos


class GridRotary(nn.Module):
    """2-D rotary embedding: half of each head's channels rotate with the row, half with the column.

    `side`: the row length of the reference grid the positions are expressed in (unset: this grid's own).
    """

    def __init__(self, head_dim: int, num_tokens: int, theta: float, side: float | None = None):
        super().__init__()
        quarter = head_dim // 4
        freqs = 1.0 / theta ** (torch.arange(quarter).float() / quarter)
        pos = _grid_positions(num_tokens, side)
        angles = torch.cat([pos[:, :1] * freqs, pos[:, 1:] * freqs], dim=-1)  # (N, head_dim / 2)
        # Buffers are not persistent: they are rebuilt from the config, so checkpoints hold weights only.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, heads, N, head_dim); rotate channel pairs (2i, 2i+1).
        n = x.shape[-2]
        cos, sin = self.cos[:n].to(x.dtype), self.sin[:n].to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query attention; self-attention when `context` is None, cross-attention otherwise.

    Queries are rotated by their grid positions, keys by theirs (`key_rotary`, defaults to the queries'), so in
    cross-attention a CLIP token can find the EVA tokens at its own place in the image.
    """

    def __init__(self, config: DiTConfig, rotary: GridRotary, key_rotary: GridRotary | None = None):
        super().__init__()
        self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.q = nn.Linear(config.hidden_size, self.heads * self.head_dim)
        self.kv = nn.Linear(config.hidden_size, 2 * self.kv_heads * self.head_dim)
        self.out = nn.Linear(self.heads * self.head_dim, config.hidden_size)
        self.rotary = rotary
        self.key_rotary = key_rotary or rotary

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        source = x if context is None else context
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q), self.key_rotary(k)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads)
        return self.out(out.transpose(1, 2).reshape(b, n, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _mlp_hidden(config: DiTConfig) -> int:
    # SwiGLU has three matrices: 2/3 of the ratio keeps the parameter count of a plain MLP of that ratio.
    return int(config.hidden_size * config.mlp_ratio * 2 / 3)


class DiTBlock(nn.Module):
    """Self-attention → cross-attention → SwiGLU, each as x + layer_scale * gate * post_norm(f(modulate(pre_norm(x)))).

    The AdaLN projection is zero-initialised, so at the start the timestep neither shifts nor scales and every gate
    is 1; the small layer scale keeps each block close to the identity until it has learned something.
    """

    SUBLAYERS = 3

    def __init__(self, config: DiTConfig):
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        # Each block owns its (non-persistent) rotary tables, so FSDP units share no modules.
        head_dim, theta = h // config.num_heads, config.rope_theta
        self.self_attn = Attention(config, GridRotary(head_dim, config.num_tokens, theta))
        side = math.isqrt(config.num_tokens)
        eva_grid = GridRotary(head_dim, config.eva_tokens or config.num_tokens, theta, side=side)
        self.cross_attn = Attention(config, GridRotary(head_dim, config.num_tokens, theta), key_rotary=eva_grid)
        self.mlp = SwiGLU(h, _mlp_hidden(config))
        self.pre_norms = nn.ModuleList(nn.RMSNorm(h, eps=eps) for _ in range(self.SUBLAYERS))
        self.post_norms = nn.ModuleList(nn.RMSNorm(h, eps=eps) for _ in range(self.SUBLAYERS))
        self.layer_scales = nn.Parameter(torch.full((self.SUBLAYERS, h), config.layer_scale_init))
        self.ada_ln = nn.Sequential(nn.SiLU(), nn.Linear(h, 3 * self.SUBLAYERS * h))
        nn.init.zeros_(self.ada_ln[1].weight)
        nn.init.zeros_(self.ada_ln[1].bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        mods = self.ada_ln(time).chunk(3 * self.SUBLAYERS, dim=-1)
        sublayers = (self.self_attn, lambda y: self.cross_attn(y, context), self.mlp)
        for i, f in enumerate(sublayers):
            shift, scale, gate = mods[3 * i : 3 * i + 3]
            y = f(_modulate(self.pre_norms[i](x), shift, scale))
            x = x + self.layer_scales[i] * (1 + gate.unsqueeze(1)) * self.post_norms[i](y)
        return x


class EvaAdapterBlock(nn.Module):
    """One step of the EVA adapter: project to the output width, then add a gated SwiGLU refinement."""

    def __init__(self, in_dim: int, out_dim: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim) if in_dim != out_dim else nn.Identity()
        self.norm = nn.RMSNorm(out_dim, eps=eps)
        self.mlp = SwiGLU(out_dim, 2 * out_dim)
        self.gate = nn.Parameter(torch.zeros(out_dim))  # tanh(0) = 0: the refinement starts switched off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return x + torch.tanh(self.gate) * self.mlp(self.norm(x))


class TimestepEmbedding(nn.Module):
    """Sinusoidal features of t ∈ [0, 1] (scaled by 1000, as in DiT) followed by an MLP."""

    def __init__(self, hidden: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = 1000.0 * t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.mlp[0].weight.dtype))


def _eva_widths(eva_dim: int, hidden: int, layers: int) -> list[int]:
    """Widths stepping geometrically from the EVA dim down to the hidden size over `layers` blocks."""
    if layers == 1:
        return [eva_dim, hidden]
    ratio = (hidden / eva_dim) ** (1 / layers)
    return [eva_dim] + [round(eva_dim * ratio**i) for i in range(1, layers)] + [hidden]


# --- the model ------------------------------------------------------------------------------------------------------


@GENERATORS.register("blip3o_dit")
class Blip3oDiT(nn.Module):
    """`forward(noisy_clip (B,N,clip_dim), t (B,), eva (B,M,eva_dim)) -> velocity (B,N,clip_dim)`."""

    model_type: ClassVar[str] = "blip3o_dit"
    Settings: ClassVar[type[DiTSettings]] = DiTSettings
    task: ClassVar[str] = "flow_matching"  # vembed.tasks: how this model is trained and evaluated

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        widths = _eva_widths(config.eva_dim, h, config.eva_adapter_layers)
        self.eva_adapter = nn.Sequential(
            *(EvaAdapterBlock(a, b, config.norm_eps) for a, b in zip(widths[:-1], widths[1:]))
        )
        self.input_proj = nn.Linear(config.clip_dim, h)
        self.time_embed = TimestepEmbedding(h)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.num_layers))
        self.out_norm = nn.RMSNorm(h, eps=config.norm_eps)
        self.out_ada_ln = nn.Sequential(nn.SiLU(), nn.Linear(h, 2 * h))
        self.out_proj = nn.Linear(h, config.clip_dim)
        for layer in (self.out_ada_ln[1], self.out_proj):  # zero output: the untrained model predicts v = 0
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    # --- what the loop and FSDP need ------------------------------------------------------------------------------
    @staticmethod
    def block_classes() -> tuple[type[nn.Module], ...]:
        """The repeated blocks FSDP wraps (one all-gather per block)."""
        return (DiTBlock,)

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "Blip3oDiT":
        from vembed.data.embedding_shards import read_index

        return cls(config_from_recipe(recipe, read_index(recipe.data.train)))

    # --- sizes for the memory planner (vembed/planning.py) ---------------------------------------------------------
    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "Blip3oDiT":
        """This recipe's DiT on the meta device (shapes, no storage). Token shapes come from the shard index of
        data.train when there is one (as in training), else from dit.eva_dim / clip_dim / num_tokens (EVA tokens then
        taken as many as CLIP tokens), so a recipe that states them plans without any data."""
        from vembed.data.embedding_shards import read_index

        dit = recipe.model.dit
        try:
            index = read_index(recipe.data.train)
        except RecipeError:
            missing = [k for k in ("eva_dim", "clip_dim", "num_tokens") if getattr(dit, k) is None]
            if missing:
                raise RecipeError(f"dit.{missing[0]}", "is needed to plan without shards: set dit.eva_dim, "
                                  "dit.clip_dim and dit.num_tokens, or point data.train at shards from "
                                  "`vembed extract`") from None
            index = {"eva_shape": [dit.num_tokens, dit.eva_dim], "clip_shape": [dit.num_tokens, dit.clip_dim],
                     "path": "the recipe"}
        with torch.device("meta"):
            return cls(config_from_recipe(recipe, index))

    def activation_elements(self, *, autocast: bool, cosine_loss: bool) -> tuple[int, int]:
        """Elements autograd keeps for backward per sample, forward and flow-matching loss: (fp32, 16-bit). In fp32
        everything is fp32. Under bf16/fp16 autocast the residual stream, RMSNorm's input and output and the loss stay
        fp32, while every matmul keeps its own 16-bit copy of its input (two of the same tensor when two projections
        read it) and attention keeps 16-bit tensors; autocast's 16-bit weight copies are not counted (the planner
        counts them with the parameters). Counted tensor by tensor from the code below and checked against
        saved-tensor hooks on CPU (tests/generation/test_dit.py). Attention is fused (flash on CUDA under
        autocast, and on CPU): it keeps its output and log-sum-exp, no N×N matrix."""
        c = self.config
        n, m, h, a = c.num_tokens, c.eva_tokens or c.num_tokens, c.hidden_size, c.num_heads
        d = h // a
        kv, f = c.num_kv_heads * d, _mlp_hidden(c)
        widths = _eva_widths(c.eva_dim, h, c.eva_adapter_layers)
        steps = list(zip(widths[:-1], widths[1:]))
        # Self-attention, cross-attention and MLP sublayers: each keeps its pre-norm's input and output, the modulated
        # input, the post-norm's input, output and scaled output; attention its rotated q/k, the k/v projection, the
        # output and log-sum-exp, the output projection's input; the MLP its gate/up output, SiLU and product.
        rows = 6 * n  # RMSNorm keeps one 1/rms per token; six norms per block
        if not autocast:
            block = 27 * n * h + 3 * n * kv + 3 * m * kv + 4 * n * f + 2 * a * n + rows + 10 * h
            eva = sum((m * i if i != o else 0) + 12 * m * o + m + 2 * o for i, o in steps)
            ends = n * c.clip_dim + 4 * n * h + n + m * h  # input projection; output norm and projection; context
            loss = 2 * n * c.clip_dim + (2 * n * c.clip_dim + 2 * n if cosine_loss else 0)
            return c.num_layers * block + eva + ends + loss, 0
        block32 = 15 * n * h + 2 * a * n + rows + 3 * h
        # 16-bit: the copies matmuls and attention keep; the context is cast again by every block's k/v projection,
        # and the rotary tables by every rotation.
        block16 = 13 * n * h + 3 * n * kv + 3 * m * kv + m * h + 4 * n * f + 3 * n * d + m * d + 4 * h
        eva32 = sum(2 * m * o + m + o for _, o in steps)
        eva16 = sum((m * i if i != o else 0) + 10 * m * o for i, o in steps)
        ends32 = 3 * n * h + n + 2 * n * c.clip_dim + (2 * n * c.clip_dim + 2 * n if cosine_loss else 0)
        ends16 = n * c.clip_dim + n * h + 256 + 2 * h  # input and output projections' inputs; timestep features
        return (c.num_layers * block32 + eva32 + ends32, c.num_layers * block16 + eva16 + ends16)

    def forward(self, noisy_clip: torch.Tensor, t: torch.Tensor, eva: torch.Tensor) -> torch.Tensor:
        context = self.eva_adapter(eva)
        time = self.time_embed(t)
        x = self.input_proj(noisy_clip)
        for block in self.blocks:
            x = block(x, context, time)
        shift, scale = self.out_ada_ln(time).chunk(2, dim=-1)
        return self.out_proj(_modulate(self.out_norm(x), shift, scale))

    @torch.no_grad()
    def generate(self, eva: torch.Tensor, *, noise: torch.Tensor | None = None, sampler: str = "heun",
                 num_steps: int = 50, seed: int = 0) -> torch.Tensor:
        """CLIP tokens (B, num_tokens, clip_dim) for EVA tokens (B, M, eva_dim), integrated from `noise` (or from
        noise drawn with `seed`): deterministic either way. The fixed data scale is undone."""
        from vembed.generation.samplers import build_sampler

        if noise is None:
            shape = (eva.shape[0], self.config.num_tokens, self.config.clip_dim)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        noise = noise.to(device=eva.device, dtype=eva.dtype)
        x = build_sampler(sampler, num_steps).sample(lambda x, t: self(x, t, eva), noise)
        return x / self.config.data_scale

    # --- persistence ----------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_model

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_model(self, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2))
        info = {"model_type": self.model_type, "embedding_dim": self.config.clip_dim, "settings": {}}
        (path / ADAPTER_FILE).write_text(json.dumps(info, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Blip3oDiT":
        from safetensors.torch import load_model

        config = DiTConfig(**json.loads(Path(path, CONFIG_FILE).read_text()))
        model = cls(config)
        load_model(model, str(Path(path, WEIGHTS_FILE)))
        return model


def config_from_recipe(recipe: "Recipe", index: dict[str, Any]) -> DiTConfig:
    """The DiT config: sizes from `dit.size` or explicit dims, token shapes from the shard index (checked against
    any the recipe states)."""
    dit = recipe.model.dit
    shapes = {"eva_dim": index["eva_shape"][1], "clip_dim": index["clip_shape"][1],
              "num_tokens": index["clip_shape"][0]}
    eva_tokens = index["eva_shape"][0]
    for key, found in shapes.items():
        stated = getattr(dit, key)
        if stated is not None and stated != found:
            raise RecipeError(
                f"dit.{key}",
                f"is {stated} but the shards in {index['path']} hold {found}; set dit.{key}: {found} or remove it",
            )
    hidden, layers, heads, kv_heads = SIZES[dit.size] if dit.size else (None, None, None, None)
    values = {
        **shapes,
        "eva_tokens": eva_tokens,
        "hidden_size": dit.hidden_size or hidden,
        "num_layers": dit.num_layers or layers,
        "num_heads": dit.num_heads or heads,
        "num_kv_heads": dit.num_kv_heads or kv_heads,
        "mlp_ratio": dit.mlp_ratio,
        "eva_adapter_layers": dit.eva_adapter_layers,
        "layer_scale_init": dit.layer_scale_init,
        "rope_theta": dit.rope_theta,
        "data_scale": recipe.loss.flow.data_scale,
    }
    missing = [k for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads") if values[k] is None]
    if missing:
        raise RecipeError(f"dit.{missing[0]}", f"is needed when dit.size is unset; set dit.size ({', '.join(SIZES)})"
                          f" or dit.{missing[0]}")
    try:
        return DiTConfig(**{f.name: values[f.name] for f in fields(DiTConfig) if f.name in values})
    except ValueError as err:
        raise RecipeError("dit", str(err)) from None
