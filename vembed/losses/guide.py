"""The guide model of GISTEmbed: a frozen embedding model, loaded from a folder vembed saved or a sentence-transformers
folder (Transformer + Pooling [+ Normalize]), that embeds each batch alongside the model being trained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from vembed.models.base import EmbeddingAdapter

KEY = "gist_guide"
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def _is_vembed_folder(folder: Path) -> bool:
    from vembed.models.base import read_adapter_file

    try:
        read_adapter_file(folder)
    except Exception:  # noqa: BLE001 - any failure means: not a vembed folder
        return False
    return True


def _sentence_transformers_pooling(folder: Path) -> str:
    """The pooling of a sentence-transformers folder whose modules are a Transformer at the root and a Pooling."""
    modules = json.loads((folder / "modules.json").read_text())
    kinds = [module.get("type", "").rsplit(".", 1)[-1] for module in modules]
    if not kinds or kinds[0] != "Transformer" or any(kind not in ("Transformer", "Pooling", "Normalize")
                                                    for kind in kinds):
        raise RecipeError(KEY, f"{str(folder)!r} is a sentence-transformers folder with modules {kinds}; a guide "
                               "must be Transformer + Pooling [+ Normalize] (or a folder vembed saved)")
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return "mean"
    config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    found = [mode for key, mode in POOLING_MODES.items() if config.get(key)]
    if len(found) != 1:
        raise RecipeError(KEY, f"{str(folder)!r}: its pooling is not one of cls, mean, last token")
    return found[0]


def check_guide_folder(folder: str) -> None:
    """Cheap, before anything is built or written: the folder exists and is a vembed or sentence-transformers model."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise RecipeError(KEY, f"{folder!r} is not a folder; give a model folder vembed saved (e.g. runs/x/final) or a "
                               "sentence-transformers folder")
    if _is_vembed_folder(path):
        return
    if (path / "modules.json").is_file():
        try:
            _sentence_transformers_pooling(path)
        except (OSError, ValueError, KeyError) as err:
            raise RecipeError(KEY, f"{folder!r} is not a readable sentence-transformers folder: {err}") from None
        return
    raise RecipeError(KEY, f"{folder!r} holds neither a vembed model nor a sentence-transformers one (no modules.json)")


def load_guide(folder: str) -> "EmbeddingAdapter":
    """The guide, frozen and in eval mode; a folder that does not load is a RecipeError naming the key."""
    check_guide_folder(folder)
    path = Path(folder).expanduser()
    try:
        if _is_vembed_folder(path):
            from vembed.models.base import load_adapter

            guide = load_adapter(path)
        else:
            from vembed.components import recipe_from_dict
            from vembed.models import MODELS

            recipe = recipe_from_dict({"model_type": "text", "model_name": str(path),
                                       "pooling": _sentence_transformers_pooling(path)})
            guide = MODELS.get("text").from_recipe(recipe)
    except RecipeError as err:
        raise RecipeError(KEY, f"{folder!r} does not load: {err.message}") from None
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a broken folder
        raise RecipeError(KEY, f"{folder!r} does not load: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    guide.eval()
    guide.requires_grad_(False)
    return guide
