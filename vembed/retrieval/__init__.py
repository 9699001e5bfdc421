"""Searching a corpus with a trained model: exact top-k search (search.py) and hard-negative mining (mining.py)."""
