"""Data: records, sources (files -> Examples), the dataset, collation, sampling, offline synthetic data.

Only the record types are imported eagerly; everything else loads on first use (torch/datasets stay unimported).
"""

from __future__ import annotations

import importlib
from typing import Any

from vembed.data.records import Example, Side

_LAZY = {
    "resolve_files": "vembed.data.paths",
    "load_examples": "vembed.data.sources",
    "load_rows": "vembed.data.sources",
    "PairRows": "vembed.data.rows",
    "DataReport": "vembed.data.reports",
    "BadRow": "vembed.data.reports",
    "PairDataset": "vembed.data.dataset",
    "PairCollator": "vembed.data.collate",
    "EpochShuffleSampler": "vembed.data.sampler",
    "SourceBatchSampler": "vembed.data.sampler",
    "load_image": "vembed.data.images",
    "make_digits_dataset": "vembed.data.synthetic",
    "make_dummy_dataset": "vembed.data.synthetic",
    "train_tokenizer": "vembed.data.tokenizer",
}

__all__ = ["Example", "Side", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vembed.data' has no attribute {name!r}")
