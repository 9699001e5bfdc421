"""The model card of a trained model (final/README.md) and of its sentence-transformers export: the facts in it are the
run's own (row counts, metrics.json's numbers, the resolved recipe, the launch), its plots are beside it, and the code
it shows runs against the saved folder."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_clip_run

from vembed.components import recipe_from_dict
from vembed.model_card import (
    CARD_FILE,
    EXAMPLE_TEXTS,
    README_FILE,
    code_blocks,
    recipe_from_card,
    render_card,
)
from vembed.training.loop import Trainer

BAD_ROW = {"query": "a row without a positive side", "label": "none"}


def _markdown_tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """(the heading above it, its rows without the header and rule) for every Markdown table in `text`."""
    tables, heading, block = [], "", []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if block:
            tables.append((heading, block))
            block = []
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    return tables


def _table(text: str, heading: str) -> list[list[str]]:
    found = [rows for title, rows in _markdown_tables(text) if title == heading]
    assert len(found) == 1, f"no single table under {heading!r}"
    return found[0]


def _evaluation(text: str) -> dict[str, dict[str, float]]:
    """column title -> metric -> value, from every table of the Evaluation section (whatever their headings)."""
    section = text.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    parsed: dict[str, dict[str, float]] = {}
    for _, rows in _markdown_tables(section):
        header, body = rows[0], rows[2:]
        for row in body:
            for title, cell in zip(header[1:], row[1:]):
                if cell != "-":
                    parsed.setdefault(title, {})[row[0]] = float(cell)
    return parsed


@pytest.fixture(scope="module")
def trained(dummy_data_dir, tmp_path_factory) -> dict:
    """A tiny CLIP run on two named training sources (one file with a row vembed skips), named validation sources, a
    plain test split, Matryoshka dims and gradient accumulation, evaluated before and after training."""
    data = tmp_path_factory.mktemp("card-data")
    rows = (dummy_data_dir / "train.jsonl").read_text().splitlines()
    (data / "shapes_a.jsonl").write_text("\n".join([*rows[:40], json.dumps(BAD_ROW)]) + "\n")
    (data / "shapes_b.jsonl").write_text("\n".join(rows[40:]) + "\n")
    raw = tiny_clip_run(
        dummy_data_dir, tmp_path_factory.mktemp("card-run") / "run", eval_before_training=True, mrl_dims=[16, 8],
        gradient_accumulation_steps=2,
        data={"train": {"a": {"files": str(data / "shapes_a.jsonl")}, "b": {"files": str(data / "shapes_b.jsonl")}},
              "validation": {"a": str(dummy_data_dir / "validation.jsonl"), "b": str(dummy_data_dir / "test.jsonl")},
              "test": str(dummy_data_dir / "test.jsonl"), "image_root": str(dummy_data_dir)},
    )
    result = Trainer(recipe_from_dict(raw)).run()
    final = result.final_model_dir
    return {"raw": raw, "final": final, "card": (final / README_FILE).read_text(),
            "metrics": json.loads((Path(raw["output_dir"]) / "metrics.json").read_text()),
            "lines": {name: len((data / f"shapes_{name}.jsonl").read_text().splitlines()) for name in "ab"},
            "eval_lines": {split: len((dummy_data_dir / f"{split}.jsonl").read_text().splitlines())
                           for split in ("validation", "test")}}


def test_card_counts_the_rows_each_source_read_kept_and_skipped(trained):
    rows = {(row[0], row[1]): row for row in _table(trained["card"], "Data")[2:]}
    lines = trained["lines"]
    # split | source | files | rows read | rows kept | rows skipped | rows evaluated
    assert rows["train", "a"][3:6] == [str(lines["a"]), str(lines["a"] - 1), "1 empty_positive"]
    assert rows["train", "b"][3:6] == [str(lines["b"]), str(lines["b"]), "0"]
    evaluated = trained["eval_lines"]
    assert rows["validation", "a"][6] == str(evaluated["validation"])
    assert rows["validation", "b"][6] == str(evaluated["test"])
    n = str(evaluated["test"])
    assert rows["test", "-"][3:7] == [n, n, "0", n]


def test_card_evaluation_tables_hold_metrics_json_numbers(trained):
    parsed = _evaluation(trained["card"])
    metrics = trained["metrics"]
    columns = {"before training (validation)": "before", "validation": "validation", "test": "test"}
    assert set(parsed) == set(columns)
    for title, split in columns.items():
        expected = metrics[split]
        assert set(parsed[title]) == set(expected)  # every metric, per source and per dimension included
        for name, value in expected.items():
            assert parsed[title][name] == pytest.approx(value, abs=5e-5), (split, name)
    assert any(name.startswith("a/q2d/dim8/") for name in parsed["validation"])  # a source's Matryoshka rows


def test_card_recipe_loads_back_as_the_run_recipe(trained):
    from vembed.components import recipe_from_dict

    assert recipe_from_dict(recipe_from_card(trained["card"])) == recipe_from_dict(trained["raw"])


def test_card_launch_and_training_length_are_the_runs(trained):
    launch = {row[0]: row[1] for row in _table(trained["card"], "Launch")[2:]}
    assert launch["world size (processes)"] == "1"
    assert launch["per-device batch"] == "8"
    assert launch["gradient accumulation steps"] == "2"
    assert launch["contrastive batch (negatives gathered across processes)"] == "8"
    assert launch["effective batch per optimizer step"] == "16"
    assert launch["GradCache"] == "off"
    assert launch["precision"] == "no"
    training = {row[0]: row[1] for row in _table(trained["card"], "Training")[2:]}
    recorded = trained["metrics"]["train"]
    assert training["optimizer steps"] == str(recorded["steps"]) == "4"
    assert training["samples seen"] == str(recorded["samples_seen"])
    assert float(training["final training loss"]) == pytest.approx(recorded["final_loss"], abs=5e-5)


def test_card_shows_the_runs_plots_from_inside_the_folder(trained):
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", trained["card"])
    assert sorted(linked) == ["accuracy_vs_dim.png", "loss_curve.png"]
    for name in linked:
        assert (trained["final"] / name).read_bytes() == (Path(trained["raw"]["output_dir"]) / name).read_bytes()


def test_card_front_matter_and_card_json(trained):
    import yaml

    front = yaml.safe_load(trained["card"].split("---\n")[1])
    assert front["library_name"] == "transformers" and "vembed" in front["tags"] and "clip" in front["tags"]
    assert "base_model" not in front  # random init: no hub model to name
    card = json.loads((trained["final"] / CARD_FILE).read_text())
    assert render_card(card, load_path=str(trained["final"])) == trained["card"]  # re-rendered without the run


def _run_block(code: str) -> torch.Tensor:
    scope: dict = {}
    exec(compile(code, "<card>", "exec"), scope)  # noqa: S102 - the card's own snippet, written by this test's run
    return torch.as_tensor(scope["embeddings"]).float()


def test_card_load_snippets_embed_as_vembed_does(trained):
    import vembed

    expected = vembed.load(str(trained["final"]), device="cpu").encode(texts=EXAMPLE_TEXTS)
    vembed_block, transformers_block, *_ = code_blocks(trained["card"])
    assert "vembed.load(" in vembed_block and len(vembed_block.splitlines()) <= 4
    torch.testing.assert_close(_run_block(vembed_block), expected)
    assert "AutoModel.from_pretrained(" in transformers_block
    torch.testing.assert_close(_run_block(transformers_block), expected, atol=1e-5, rtol=0)


def test_export_writes_a_card_whose_snippet_loads_the_export(trained, tmp_path):
    pytest.importorskip("sentence_transformers")
    import vembed
    from vembed.export import export_sentence_transformers

    out = export_sentence_transformers(trained["final"], tmp_path / "final-st")
    text = (out / README_FILE).read_text()
    st_block, mteb_block = code_blocks(text)
    assert f"SentenceTransformer({str(out)!r})" in st_block
    expected = vembed.load(str(trained["final"]), device="cpu").encode(texts=EXAMPLE_TEXTS)
    torch.testing.assert_close(_run_block(st_block), expected, atol=1e-5, rtol=0)
    # MTEB needs the Hub for its tasks: the snippet is checked for the MTEB 2 API, not run.
    compile(mteb_block, "<mteb>", "exec")
    assert "mteb.get_tasks(tasks=" in mteb_block and "mteb.evaluate(model, tasks=tasks)" in mteb_block
    assert _evaluation(text) == _evaluation(trained["card"])  # the same numbers, from final/'s card.json
    assert (out / "loss_curve.png").is_file() and (out / CARD_FILE).is_file()
    assert "library_name: sentence-transformers" in text


def test_export_of_a_folder_without_a_run_record_says_so(trained, tmp_path):
    pytest.importorskip("sentence_transformers")
    from vembed.export import export_sentence_transformers

    bare = tmp_path / "bare"
    shutil.copytree(trained["final"], bare)
    for name in (README_FILE, CARD_FILE, "loss_curve.png", "accuracy_vs_dim.png"):
        (bare / name).unlink()
    text = (export_sentence_transformers(bare, tmp_path / "st") / README_FILE).read_text()
    assert "No training record came with this folder" in text and "## Evaluation" not in text


def test_card_renders_metric_names_it_does_not_know():
    evaluation = {"test": {"ndcg@10": 0.5, "map@100": 0.25, "recall@100": 0.75, "corpus/ndcg@10": 0.125,
                           "q2d/dim32/ndcg@10": 0.375, "num_queries": 7.0}}
    card = {"model": {"model_type": "text", "embedding_dim": 64, "settings": {}}, "evaluation": evaluation}
    parsed = _evaluation(render_card(card))
    assert parsed == {"test": evaluation["test"]}


def test_a_card_that_fails_to_render_leaves_the_model_without_it(dummy_data_dir, tmp_path, monkeypatch, capsys):
    import vembed.model_card

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(vembed.model_card, "render_card", broken)
    raw = tiny_clip_run(dummy_data_dir, tmp_path / "run", max_steps=1, save_steps=None)
    final = Trainer(recipe_from_dict(raw)).run().final_model_dir
    assert (final / "model.safetensors").is_file() and not (final / README_FILE).exists()
    assert not (final / CARD_FILE).exists() and not list(final.glob("*.png"))
    assert "final/ has no model card: KeyError" in capsys.readouterr().out


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_text_model_transformers_snippet_pools_as_vembed_does(tiny_tokenizer_dir, tmp_path, pooling):
    """A folder saved outside a run: the card comes from its vembed.json, and its plain-transformers snippet pools
    as the adapter does."""
    from transformers import AutoTokenizer

    import vembed
    from vembed.data.tokenizer import special_token_ids
    from vembed.model_card import folder_card
    from vembed.models import MODELS

    config = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
              "num_attention_heads": 4, "max_position_embeddings": 16,
              **special_token_ids(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))}
    raw = {"model_type": "text", "tokenizer_name": tiny_tokenizer_dir, "model_config": config, "pooling": pooling}
    torch.manual_seed(0)
    MODELS.get("text").from_recipe(recipe_from_dict(raw)).save(tmp_path)
    card = render_card(folder_card(tmp_path), load_path=str(tmp_path))
    transformers_block = code_blocks(card)[1]
    expected = vembed.load(str(tmp_path), device="cpu").encode(texts=EXAMPLE_TEXTS)
    torch.testing.assert_close(_run_block(transformers_block), expected, atol=1e-5, rtol=0)


def test_front_matter_names_a_hub_base_model_and_not_a_local_path():
    import yaml

    def front(recipe: dict) -> dict:
        from vembed.model_card import base_models

        card = {"model": {"model_type": "text", "embedding_dim": 8, "settings": {}, "base": base_models(recipe)},
                "recipe": recipe}
        return yaml.safe_load(render_card(card).split("---\n")[1])

    hub = front({"model_name": "sentence-transformers/all-MiniLM-L6-v2", "tokenizer_name": "other/tokenizer"})
    assert hub["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert hub["library_name"] == "transformers" and "sentence-similarity" in hub["tags"]
    assert "base_model" not in front({"model_name": "/models/minilm"})
    composed = front({"text_model_name": "bert-base-uncased", "vision_model_name": "google/vit-base-patch16-224"})
    assert composed["base_model"] == ["bert-base-uncased", "google/vit-base-patch16-224"]


@pytest.mark.parametrize("model_type", ["composed", "qwen_vl"])
def test_adapters_without_a_transformers_equivalent_say_so(model_type):
    import yaml

    card = render_card({"model": {"model_type": model_type, "embedding_dim": 8, "settings": {}}}, load_path="m")
    assert yaml.safe_load(card.split("---\n")[1])["library_name"] == "vembed"
    assert f"Not without vembed: a `{model_type}` model's embedding is computed by vembed's adapter" in card
    assert "`vembed export` refuses it" in card and "SentenceTransformer(" not in card
    assert len(code_blocks(card)) == 1  # vembed.load only


def test_multi_vector_card_states_what_the_scores_depend_on_and_how_pylate_loads_it():
    import yaml

    settings = {"embedding": "multi_vector", "multi_vector_dim": 128, "query_prefix": "[Q] ", "document_prefix": "",
                "query_length": 32, "max_length": 180, "skip_punctuation": False, "normalize": True}
    card = render_card({"model": {"model_type": "text", "embedding_dim": 128, "settings": settings}}, load_path="m")
    assert {"ColBERT", "PyLate"} <= set(yaml.safe_load(card.split("---\n")[1])["tags"])
    assert "Token vectors (ColBERT late interaction) of 128 dimensions, L2-normalised" in card
    rows = dict(_table(card, "Late interaction"))
    assert rows["token vector size"] == "128" and rows["score"].startswith("MaxSim")
    assert rows["query prefix"] == "`'[Q] '` (one token)" and rows["document prefix"] == "none"
    assert rows["query length"].startswith("32 tokens") and rows["document length"] == "at most 180 tokens"
    assert rows["punctuation skip-list"] == "off"
    vembed_block, pylate_block = code_blocks(card)
    assert "encode_token_vectors" in vembed_block and "models.ColBERT('m')" in pylate_block
    assert "MultiVectorEncoder('m')" in card and "SentenceTransformer(" not in card
