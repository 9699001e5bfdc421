"""The guide model of GISTEmbed: a frozen embedding model from any folder vembed can score with
(`vembed.models.foreign`: a folder vembed saved, a sentence-transformers folder, a transformers folder), that embeds
each batch alongside the model being trained."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from vembed.models.base import EmbeddingAdapter

KEY = "gist_guide"


def check_guide_folder(folder: str) -> None:
    """Cheap, before anything is built or written: the folder holds a model vembed can load (its files, not yet its
    weights)."""
    from vembed.models.base import ADAPTER_FILE
    from vembed.models.foreign import HF_CONFIG, ST_MODULES, require_embedder

    path = require_embedder(folder, KEY, instead="the guide embeds every batch; name an embedding model")
    if not any((path / name).is_file() for name in (ADAPTER_FILE, ST_MODULES, HF_CONFIG)):
        raise RecipeError(KEY, f"{folder!r} holds no model: no {ADAPTER_FILE} (vembed), {ST_MODULES} "
                               f"(sentence-transformers) or {HF_CONFIG} (transformers); give a model folder")
    if not (path / ADAPTER_FILE).is_file() and (path / ST_MODULES).is_file():
        try:
            json.loads((path / ST_MODULES).read_text())
        except (OSError, ValueError) as err:
            raise RecipeError(KEY, f"{folder!r} is not a readable sentence-transformers folder: {err}") from None


def load_guide(folder: str) -> "EmbeddingAdapter":
    """The guide, frozen and in eval mode; a folder that does not load is a RecipeError naming the key."""
    from vembed.models.foreign import load_embedding_model

    check_guide_folder(folder)
    try:
        guide = load_embedding_model(folder, key=KEY)
    except RecipeError as err:
        raise RecipeError(KEY, f"{folder!r} does not load: {err.message}") from None
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a broken folder
        raise RecipeError(KEY, f"{folder!r} does not load: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    guide.eval()
    guide.requires_grad_(False)
    return guide
