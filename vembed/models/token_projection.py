"""`embedding: multi_vector` on any adapter that has last hidden states (text's ColBERT, qwen_vl's ColQwen): the keys,
the bias-free projection of every state to `multi_vector_dim`, L2-normalised, zero where there is no token (the
`vembed.models.token_vectors` contract), and the projection's saved file. One home, so both adapters give, size,
save and load token vectors alike; which positions are tokens (and any prompt format) stays the adapter's.

The projection is a plain `nn.Linear` beside the transformer (`adapter.projection`), outside the towers LoRA wraps:
it is new, so it is always trained fully (as colpali-engine's `custom_text_proj`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from vembed.errors import RecipeError
from vembed.models.pylate_folder import PROJECTION_FOLDER, read_projection
from vembed.recipe import InvalidKey, Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class TokenVectorSettings(Settings):
    """The keys of an adapter that can give token vectors; mixed into its Settings."""

    # single: one vector per side (the adapter's pooling); multi_vector: one per token (late interaction, loss_type
    # late_interaction). The keys below (and an adapter's `token_vector_keys`) apply to multi_vector only.
    embedding: Literal["single", "multi_vector"] = "single"
    multi_vector_dim: int = Field(default=128, gt=0)  # size of each token vector (the bias-free projection's output)

    # Keys that mean something with token vectors only: refused with embedding: single unless left at the default.
    token_vector_keys: ClassVar[tuple[str, ...]] = ("multi_vector_dim",)

    @model_validator(mode="after")
    def _multi_vector_keys(self) -> "TokenVectorSettings":
        if self.embedding == "multi_vector":
            if not getattr(self, "normalize", True):
                raise InvalidKey("normalize", "token vectors are always L2-normalised (their padding is the zero "
                                              "vector); remove normalize: false or use embedding: single")
            return self
        # By value, not by presence: a saved recipe (every key written out) must read back.
        for key in self.token_vector_keys:
            if getattr(self, key) != type(self).model_fields[key].default:
                raise InvalidKey(key, "applies to token vectors only; set embedding: multi_vector or remove it")
        return self

    @property
    def multi_vector(self) -> bool:
        return self.embedding == "multi_vector"


class TokenVectors:
    """Mixed into an adapter (before `TransformersAdapter`) whose Settings derive from TokenVectorSettings: sizes, the
    projection, and its loading. The adapter calls `add_projection` when built and `token_vectors` in `encode`; `load`
    reads a saved folder's projection back; the adapter writes it with its own folder layout."""

    settings: Any
    projection: nn.Linear
    # What a model card says of this adapter's token vectors (vembed/model_card.py): the family's name (its title),
    # its Hub tags, and whether the saved folder loads in PyLate too.
    late_interaction_name: ClassVar[str] = "multi-vector"
    card_tags: ClassVar[tuple[str, ...]] = ()
    pylate_folder: ClassVar[bool] = False

    @classmethod
    def card_rows(cls, settings: dict[str, Any]) -> list[list[Any]]:
        """The card's late-interaction rows besides size and score: what else the vectors depend on (saved
        `settings`, as in vembed.json)."""
        return []

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        settings = cls.settings_of(recipe)  # type: ignore[attr-defined]
        return settings.multi_vector_dim if settings.multi_vector else super().embedding_dim_for(recipe)  # type: ignore[misc]

    @property
    def embedding_dim(self) -> int:
        """The size of one vector: a side's (single) or a token's (multi_vector)."""
        return self.settings.multi_vector_dim if self.settings.multi_vector else super().embedding_dim  # type: ignore[misc]

    def add_projection(self, hidden_size: int, device: torch.device) -> None:
        """New weights on the model's device (meta when planned); a saved folder's are read by `load_projection`."""
        self.projection = nn.Linear(hidden_size, self.settings.multi_vector_dim, bias=False, device=device)

    def token_vectors(self, hidden: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """`(n, T, multi_vector_dim)` float32: each state `hidden` `(n, T, h)` projected and L2-normalised where `kept`
        `(n, T)` is true, the zero vector elsewhere."""
        vectors = F.normalize(self.projection(hidden).float(), dim=-1)
        return vectors * kept.unsqueeze(-1)

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> Any:
        """The saved adapter (the next class's `load`), with its token projection read back from `path`."""
        adapter = super().load(path, trust_remote_code=trust_remote_code)  # type: ignore[misc]
        if adapter.settings.multi_vector:
            adapter.load_projection(path)
        return adapter

    def load_projection(self, path: str | Path) -> None:
        """The token projection saved in `path/1_Dense` (sentence-transformers' Dense layout)."""
        try:
            weight = read_projection(path)
        except FileNotFoundError as missing:
            raise RecipeError("model", f"{str(path)!r} holds a multi_vector model without its projection "
                                       f"({missing})") from None
        if tuple(weight.shape) != tuple(self.projection.weight.shape):
            file = Path(path, PROJECTION_FOLDER)
            raise RecipeError("multi_vector_dim", f"{file} projects {weight.shape[1]} -> {weight.shape[0]}, but this "
                                                  f"model needs {self.projection.in_features} -> "
                                                  f"{self.projection.out_features}; set multi_vector_dim: "
                                                  f"{weight.shape[0]}")
        with torch.no_grad():
            self.projection.weight.copy_(weight)


__all__ = ["TokenVectorSettings", "TokenVectors"]
