"""A reranker's model card (final/README.md): listed as a reranker, its evaluation as what it adds (first stage,
reranked, change: metrics.json's numbers), and snippets that score pairs as vembed does, in vembed and in
sentence-transformers' CrossEncoder."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from vembed.model_card import CARD_FILE, code_blocks, render_card


@pytest.fixture
def validated_run(rerank_recipe, tmp_path):
    from corpora import make_corpus_folder
    from rerank_lists import write_first_stage_run

    from vembed.components import recipe_from_dict
    from vembed.data.corpus import load_corpus_split
    from vembed.recipe_checks import check_recipe
    from vembed.training.loop import Trainer

    folder = make_corpus_folder(tmp_path / "corpus")
    run = write_first_stage_run(load_corpus_split(folder, "dev"), tmp_path / "dev.trec")
    raw = dict(rerank_recipe, eval_before_training=True, eval_steps=1,
               data=dict(rerank_recipe["data"], validation=str(folder), first_stage_run=str(run)))
    recipe = recipe_from_dict(raw)
    check_recipe(recipe)
    result = Trainer(recipe).run()
    final = result.final_model_dir
    return {"final": final, "metrics": result.metrics, "card": (final / "README.md").read_text()}


def _section_tables(card: str, section: str) -> dict[str, list[list[str]]]:
    """heading -> rows (header first) of the Markdown tables in `## section`."""
    body = card.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    tables, heading = {}, ""
    for line in body.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and not set(line) <= set("|-"):
            tables.setdefault(heading, []).append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return tables


def test_a_reranker_card_says_what_it_adds_and_scores_as_vembed_does(validated_run):
    from sentence_transformers import CrossEncoder

    from vembed.reranking import load_reranker
    from vembed.reranking.pairs import EXAMPLE_DOCUMENTS, EXAMPLE_QUERY

    card, final, metrics = validated_run["card"], validated_run["final"], validated_run["metrics"]
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["pipeline_tag"] == "text-ranking" and front["library_name"] == "sentence-transformers"
    assert {"reranker", "cross-encoder", "cross_encoder"} <= set(front["tags"])
    assert "a vembed cross_encoder reranker" in card.splitlines()[card.splitlines().index("---", 1) + 2]
    assert "embedding model" not in card and "load_generator" not in card

    # Every evaluated split is a first stage / reranked / change table of metrics.json's own numbers.
    tables = _section_tables(card, "Evaluation")
    assert len(tables) == 2  # before training, and the final validation
    for key in ("before", "validation"):
        (heading, rows), = [(h, r) for h, r in tables.items() if h.startswith(
            "before training" if key == "before" else "validation")]
        assert f"({int(metrics[key]['reranked/num_queries'])} judged queries)" in heading
        assert rows[0] == ["metric", "first stage", "reranked", "change"]
        shown = {row[0]: row[1:] for row in rows[1:]}
        assert list(shown)[:2] == ["ndcg@10", "mrr@10"]  # the headline metrics first
        for name, (first, reranked, change) in shown.items():
            before, after = metrics[key][f"first_stage/{name}"], metrics[key][f"reranked/{name}"]
            assert (float(first), float(reranked)) == (pytest.approx(before, abs=5e-5), pytest.approx(after, abs=5e-5))
            assert float(change) == pytest.approx(after - before, abs=5e-5)
    assert f"Best validation `reranked/ndcg@10` during training: {metrics['best']['value']:.4f}" in card

    # The snippets run against the saved folder and give vembed's scores.
    expected = load_reranker(final).score([EXAMPLE_QUERY] * len(EXAMPLE_DOCUMENTS), EXAMPLE_DOCUMENTS)
    vembed_block, st_block = code_blocks(card)
    scope: dict = {}
    exec(compile(vembed_block, "<card>", "exec"), scope)  # noqa: S102 - the card's own snippet of this test's run
    torch.testing.assert_close(scope["scores"], expected)
    scope = {}
    exec(compile(st_block, "<card>", "exec"), scope)  # noqa: S102
    assert isinstance(scope["model"], CrossEncoder)
    torch.testing.assert_close(torch.as_tensor(scope["scores"]).float(), expected, atol=1e-5, rtol=0)
    assert [hit["corpus_id"] for hit in scope["ranked"]] == expected.argsort(descending=True).tolist()

    # Re-rendered from card.json alone (vembed export or a later render): the same card.
    assert render_card(json.loads((final / CARD_FILE).read_text()), load_path=str(final)) == card


def test_a_qwen_vl_reranker_card_shows_its_image_call_and_the_transformers_layout(qwen_rerank_recipe):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    final = Trainer(recipe_from_dict(dict(qwen_rerank_recipe, max_steps=1))).run().final_model_dir
    card = (final / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["pipeline_tag"] == "text-ranking" and front["library_name"] == "transformers"
    assert "a vembed qwen_vl_reranker reranker" in card and "pair read jointly for image and text" in card
    (block,) = code_blocks(card)
    assert "load_reranker(" in block and "Side(image=" in block
    assert "AutoModelForImageTextToText.from_pretrained(" in card
    assert "No evaluation was recorded" in card
