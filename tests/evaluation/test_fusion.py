"""Fusion through ranx: reciprocal rank fusion by hand, weighted sums equal to ranx's own, queries one run lacks, and
each bad choice refused with its flag."""

from __future__ import annotations

import pytest

from vembed.errors import RecipeError
from vembed.evaluation.fusion import METHODS, fuse_runs

DENSE = {"q": {"d1": 0.9, "d2": 0.8, "d3": 0.1}, "r": {"d1": 0.3}}
LEXICAL = {"q": {"d3": 12.0, "d4": 7.0}}


def test_rrf_is_the_sum_of_one_over_k_plus_rank():
    fused = fuse_runs([DENSE, LEXICAL])
    assert fused["q"] == pytest.approx({"d1": 1 / 61, "d2": 1 / 62, "d3": 1 / 63 + 1 / 61, "d4": 1 / 62}, abs=1e-12)
    assert fused["r"] == pytest.approx({"d1": 1 / 61}, abs=1e-12)  # only one run holds it
    assert fuse_runs([DENSE, LEXICAL], k=1)["q"]["d3"] == pytest.approx(1 / 4 + 1 / 2, abs=1e-12)


def test_weighted_fusion_equals_ranx_on_the_runs_filled_with_empty_queries():
    from ranx import Run, fuse

    fused = fuse_runs([DENSE, LEXICAL], "weighted", weights=[0.25, 0.75])
    theirs = fuse([Run(DENSE), Run({"q": LEXICAL["q"], "r": {}})], norm="min-max", method="wsum",
                  params={"weights": [0.25, 0.75]}).to_dict()
    assert fused == {q: pytest.approx(v, abs=1e-12) for q, v in theirs.items()}
    # min-max per query: d1 is dense's best (1.0), d3 lexical's best (1.0) and dense's worst (0.0).
    assert fused["q"]["d1"] == pytest.approx(0.25) and fused["q"]["d3"] == pytest.approx(0.75)
    unnormalised = fuse_runs([DENSE, LEXICAL], "weighted", weights=[1.0, 1.0], norm="none")
    assert unnormalised["q"]["d3"] == pytest.approx(12.1)


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"weighted"}))
def test_every_method_fuses_both_queries(method):
    fused = fuse_runs([DENSE, LEXICAL], method)
    assert set(fused) == {"q", "r"} and set(fused["q"]) == {"d1", "d2", "d3", "d4"}


@pytest.mark.parametrize("runs, method, options, key", [
    ([DENSE], "rrf", {}, "runs"),
    ([DENSE, LEXICAL], "borda", {}, "--method"),
    ([DENSE, LEXICAL], "rrf", {"norm": "zscore"}, "--norm"),
    ([DENSE, LEXICAL], "weighted", {}, "--weights"),
    ([DENSE, LEXICAL], "weighted", {"weights": [1.0]}, "--weights"),
    ([DENSE, LEXICAL], "weighted", {"weights": [1.0, -0.5]}, "--weights"),
    ([DENSE, LEXICAL], "weighted", {"weights": [0.0, 0.0]}, "--weights"),
    ([DENSE, LEXICAL], "rrf", {"weights": [1.0, 1.0]}, "--weights"),
    ([DENSE, LEXICAL], "rrf", {"k": 0}, "--rrf-k"),
])
def test_bad_choices_name_their_flag(runs, method, options, key):
    with pytest.raises(RecipeError) as error:
        fuse_runs(runs, method, **options)
    assert error.value.key == key


def test_weights_at_the_boundary_are_accepted():
    assert fuse_runs([DENSE, LEXICAL], "weighted", weights=[0.0, 1.0])["q"]["d3"] == pytest.approx(1.0)
    assert fuse_runs([DENSE, LEXICAL], "rrf", k=1)["r"]["d1"] == pytest.approx(0.5)
