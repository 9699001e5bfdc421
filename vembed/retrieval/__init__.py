"""Searching a corpus with a trained model: exact top-k search (search.py) and hard-negative mining (mining.py)."""

from vembed.registry import Registry

# How each embedding kind's documents are kept and scored (`search.Scoring`), by the adapter's `embedding_kind`:
# "single" in search.py, "multi_vector" in maxsim_search.py, "sparse" in sparse_index.py. Here, so that no module
# imports another for it.
SCORINGS: Registry = Registry("embedding", modules=("vembed.retrieval.search", "vembed.retrieval.maxsim_search",
                                                     "vembed.retrieval.sparse_index"))
