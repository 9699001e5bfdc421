"""PyLate's layout of a saved ColBERT (text `embedding: multi_vector`): the files besides the HF model that make
`pylate.models.ColBERT(path)` load the folder and encode as vembed does, read from PyLate 1.6's loader (it sits on
sentence-transformers' folder format):

- `modules.json`: module 0, the transformer in the folder's root; module 1, the bias-free projection in `1_Dense/`;
- `sentence_bert_config.json`: the transformer module's truncation;
- `1_Dense/config.json` + `model.safetensors` (`linear.weight`): the projection, as sentence-transformers' and
  PyLate's Dense layer save it;
- `config_sentence_transformers.json`: PyLate's ColBERT keys, each one a decision vembed's ColBERT makes
  (`vembed/models/text.py`): the prefixes, the fixed query length with mask-token expansion that is attended, the
  document length, the punctuation skip-list, MaxSim. `model_type: ColBERT` is what PyLate writes, and what
  sentence-transformers >= 6 reads as a PyLate folder (`MultiVectorEncoder`).

Token vectors are L2-normalised by PyLate's `encode` itself (its default), as by vembed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vembed.models.text import TextSettings

PROJECTION_FOLDER = "1_Dense"  # where PyLate and sentence-transformers keep the Dense module
PROJECTION_FILE = "model.safetensors"
PROJECTION_KEY = "linear.weight"
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": PROJECTION_FOLDER, "type": "pylate.models.Dense.Dense"},
]


def pylate_config(settings: "TextSettings", skiplist_words: list[str]) -> dict[str, Any]:
    """`config_sentence_transformers.json`: the keys PyLate's ColBERT reads back (`ColBERT._load_sbert_model`)."""
    return {
        "model_type": "ColBERT",
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "MaxSim",
        # PyLate inserts each prefix as one token after [CLS]; vembed adds the same token to the vocabulary.
        "query_prefix": settings.query_prefix,
        "document_prefix": settings.document_prefix,
        "query_length": settings.query_length,
        "document_length": settings.max_length,
        "do_query_expansion": True,
        # vembed's query expansion tokens are attended (PyLate's default, after the ColBERT code, is not).
        "attend_to_expansion_tokens": True,
        # Written out, not left to PyLate's default (all of string.punctuation): PyLate maps a character the
        # vocabulary lacks to the unknown token and would skip [UNK] in documents, which vembed keeps.
        "skiplist_words": skiplist_words,
    }


def write_pylate_files(path: str | Path, settings: "TextSettings", projection: torch.Tensor,
                       skiplist_words: list[str]) -> None:
    """Write the projection (`(dim, hidden)` weight) and PyLate's configuration files into the saved folder `path`
    (the HF model and tokenizer are already there)."""
    write_projection(path, projection)
    files = {
        Path(path, "modules.json"): MODULES,
        # The transformer's own truncation; PyLate sets it per call (query_length or document_length, minus the
        # prefix token), so this only matters to readers that use the module alone.
        Path(path, "sentence_bert_config.json"): {"max_seq_length": settings.max_length, "do_lower_case": False},
        Path(path, "config_sentence_transformers.json"): pylate_config(settings, skiplist_words),
    }
    for file, content in files.items():
        file.write_text(json.dumps(content, indent=2))


def write_projection(path: str | Path, projection: torch.Tensor) -> None:
    """The `(dim, hidden)` projection weight into `path/1_Dense`, as sentence-transformers' and PyLate's Dense layer
    save it (every multi_vector model's projection file, PyLate folder or not)."""
    from safetensors.torch import save_file

    folder = Path(path, PROJECTION_FOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    weight = projection.detach().float().cpu().contiguous()
    save_file({PROJECTION_KEY: weight}, str(folder / PROJECTION_FILE))
    dense = {"in_features": weight.shape[1], "out_features": weight.shape[0], "bias": False,
             "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}
    (folder / "config.json").write_text(json.dumps(dense, indent=2))


def read_projection(path: str | Path) -> torch.Tensor:
    """The `(dim, hidden)` projection weight saved in `path/1_Dense` (ours or PyLate's); FileNotFoundError if none."""
    from safetensors.torch import load_file

    file = Path(path, PROJECTION_FOLDER, PROJECTION_FILE)
    if not file.is_file():
        raise FileNotFoundError(file)
    return load_file(str(file))[PROJECTION_KEY]


__all__ = ["MODULES", "PROJECTION_FOLDER", "pylate_config", "read_projection", "write_projection",
           "write_pylate_files"]
