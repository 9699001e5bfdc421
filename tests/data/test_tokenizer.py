"""vembed/data/tokenizer.py: the offline tokenizer of the tests and the examples."""

from __future__ import annotations

from transformers import AutoTokenizer


def test_pair_encoding_separates_query_and_document(tiny_tokenizer_dir):
    """A cross-encoder reads `tokenizer(query, document)`: the two texts must come marked (BOS query EOS document EOS),
    not run together with nothing between them (the pair template was missing, so the tiny reranker saw one
    unmarked sequence)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    query, document = "a red circle", "a blue square"
    single = tokenizer(query)["input_ids"]
    pair = tokenizer(query, document)["input_ids"]
    second = tokenizer(document, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert single[0] == bos and single[-1] == eos  # the single-text template is unchanged
    assert pair == single + second + [eos]


def test_pair_truncation_keeps_the_separators(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    pair = tokenizer("a red circle " * 5, "a blue square " * 5, truncation="longest_first", max_length=12)["input_ids"]
    assert len(pair) == 12 and pair[0] == tokenizer.bos_token_id and pair[-1] == tokenizer.eos_token_id
    assert pair.count(tokenizer.eos_token_id) == 2
