"""vembed/data/sources.py with paths.py, tables.py and reports.py: finding files, reading rows into Examples,
skipping and counting bad rows."""

from __future__ import annotations

import json
import os

import pytest

from data_files import write_jsonl as _jsonl

from vembed.data.paths import check_data_paths, resolve_files
from vembed.data.sources import load_examples
from vembed.errors import DataError, RecipeError
from vembed.recipe import DataConfig


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))


@pytest.fixture(params=["small", "mapped"])
def json_reading(request, monkeypatch):
    """JSON read both ways: with the standard library (small files) and memory-mapped through datasets (large)."""
    if request.param == "mapped":
        monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)
    return request.param


def _png(path, colour=(255, 0, 0)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), colour).save(path)
    return path


ROWS = [
    {"query": "a red square", "positive": "doc one", "negatives": ["n1", "n2"], "label": 1},
    {"query": "a blue circle", "positive": "doc two", "negatives": ["n3", "n4", "n5"], "label": 2},
    {"query": "a green triangle", "positive": "doc three", "negatives": ["n6", "n7"], "label": 3},
]


def _write(tmp_path, fmt, rows=ROWS):
    import pandas as pd

    if fmt == "jsonl":
        return _jsonl(tmp_path / "pairs.jsonl", rows)
    frame = pd.DataFrame(rows)
    if fmt == "csv":
        frame["negatives"] = [json.dumps(n) for n in frame["negatives"]]  # a CSV cell holds a list as JSON
        frame.to_csv(tmp_path / "pairs.csv", index=False)
        return tmp_path / "pairs.csv"
    frame.to_parquet(tmp_path / "pairs.parquet")
    return tmp_path / "pairs.parquet"


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_each_format_reads_the_same_examples(tmp_path, fmt, json_reading):
    path = _write(tmp_path, fmt)
    examples, report = load_examples(DataConfig(train=str(path)), "train")
    assert [e.query.text for e in examples] == ["a red square", "a blue circle", "a green triangle"]
    assert [e.positive.text for e in examples] == ["doc one", "doc two", "doc three"]
    # unset num_hard_negatives: the smallest count (2); the longer list is truncated
    assert [[n.text for n in e.negatives] for e in examples] == [["n1", "n2"], ["n3", "n4"], ["n6", "n7"]]
    assert [e.label for e in examples] == ["1", "2", "3"]
    assert [(e.source, e.row) for e in examples] == [(str(path), 1), (str(path), 2), (str(path), 3)]
    assert (report.total, report.kept, report.skipped, report.num_hard_negatives) == (3, 3, {}, 2)


def test_columns_are_mapped_and_absent_ones_unused(tmp_path):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "why?", "answer": "because", "topic": "x"}])
    cfg = DataConfig(train=str(path), columns={"query": "question", "positive": "answer", "label": "topic"})
    (example,), report = load_examples(cfg, "train")
    assert (example.query.text, example.positive.text, example.label) == ("why?", "because", "x")
    assert example.negatives == [] and report.num_hard_negatives == 0


def test_missing_query_column_names_the_file_and_its_columns(tmp_path):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "why?", "positive": "because"}])
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(train=str(path)), "train")
    message = str(err.value)
    assert str(path) in message and "no query column" in message and "'query_image'" in message
    assert "['question', 'positive']" in message and "data.columns" in message
    assert "positive column" not in message


def test_relative_images_resolve_against_the_file_directory_or_image_root(tmp_path):
    _png(tmp_path / "data" / "img" / "a.png")
    _png(tmp_path / "pics" / "img" / "a.png")
    absolute = _png(tmp_path / "elsewhere" / "b.png")
    path = _jsonl(
        tmp_path / "data" / "pairs.jsonl",
        [{"query": "a", "positive_image": "img/a.png"}, {"query": "b", "positive_image": str(absolute)}],
    )
    examples, _ = load_examples(DataConfig(train=str(path)), "train")
    assert [e.positive.image for e in examples] == [str(tmp_path / "data" / "img" / "a.png"), str(absolute)]
    examples, _ = load_examples(DataConfig(train=str(path), image_root=str(tmp_path / "pics")), "train")
    assert examples[0].positive.image == str(tmp_path / "pics" / "img" / "a.png")
    assert all(os.path.isabs(e.positive.image) for e in examples)


def test_negative_texts_and_images_pair_by_position(tmp_path, json_reading):
    _png(tmp_path / "n1.png")
    _png(tmp_path / "n2.png")
    path = _jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"query": "q", "positive": "p", "negatives": ["t1", "t2"], "negative_images": ["n1.png", "n2.png"]},
            {"query": "q", "positive": "p", "negatives": "only one", "negative_images": "n1.png"},
        ],
    )
    examples, report = load_examples(DataConfig(train=str(path)), "train", num_hard_negatives=1)
    first = examples[0].negatives
    assert len(first) == 1 and first[0].text == "t1" and first[0].image == str(tmp_path / "n1.png")
    assert examples[1].negatives[0].text == "only one"
    assert report.num_hard_negatives == 1


def test_explicit_num_hard_negatives_skips_rows_with_fewer(tmp_path, json_reading):
    rows = [{"query": f"q{i}", "positive": "p", "negatives": ["a", "b", "c"]} for i in range(9)]
    rows.append({"query": "short", "positive": "p", "negatives": ["a"]})
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    examples, report = load_examples(DataConfig(train=str(path), num_hard_negatives=2, max_bad_fraction=0.2), "train")
    assert len(examples) == 9 and all(len(e.negatives) == 2 for e in examples)
    # left out as short of negatives, not as bad data (vembed mine leaves such queries out on purpose)
    assert report.skipped == {} and report.short == 1 and not report.bad_rows
    # the argument wins over the config (evaluation splits pass 0)
    examples, report = load_examples(DataConfig(train=str(path), num_hard_negatives=2), "train", num_hard_negatives=0)
    assert len(examples) == 10 and report.num_hard_negatives == 0 and all(e.negatives == [] for e in examples)


def test_empty_rows_and_missing_images_are_skipped_and_counted(tmp_path, json_reading):
    _png(tmp_path / "ok.png")
    rows = [{"query": f"q{i}", "positive_image": "ok.png"} for i in range(7)]
    rows += [
        {"query": "   ", "positive_image": "ok.png"},  # row 8: blank query
        {"query": "q", "positive": None},  # row 9: no positive
        {"query": "q", "positive_image": "gone.png"},  # row 10: missing image
        {"query": "q", "positive_image": "ok.png", "negative_images": ["gone.png"]},  # row 11: missing negative
    ]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    examples, report = load_examples(DataConfig(train=str(path), max_bad_fraction=0.5), "train")
    assert len(examples) == 7
    assert (report.total, report.kept, report.num_skipped) == (11, 7, 4)
    assert report.skipped == {"empty_query": 1, "empty_positive": 1, "missing_image": 2}
    reasons = [(bad.row, bad.reason) for bad in report.bad_rows]
    assert reasons == [(8, "empty_query"), (9, "empty_positive"), (10, "missing_image"), (11, "missing_image")]
    assert "gone.png" in report.bad_rows[2].detail
    assert "kept 7 of 11" in report.summary() and "2 missing_image" in report.summary()


def test_too_many_bad_rows_raise_naming_file_row_and_fix(tmp_path, json_reading):
    rows = [{"query": "q", "positive": "p"}] * 8 + [{"query": "", "positive": "p"}] * 2
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(train=str(path), max_bad_fraction=0.1), "train")
    assert (err.value.file, err.value.row) == (str(path), 9)
    message = str(err.value)
    assert "2 of 10" in message and "2 empty_query" in message and "data.max_bad_fraction" in message
    assert f"{path}, row 9" in message


def test_the_report_names_the_first_bad_rows_up_to_its_limit(tmp_path):
    from vembed.data.reports import MAX_BAD_ROWS_SHOWN

    bad = MAX_BAD_ROWS_SHOWN + 2
    rows = [{"query": "", "positive": "p"}] * bad + [{"query": "q", "positive": "p"}] * bad
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    _, report = load_examples(DataConfig(train=str(path), max_bad_fraction=0.5), "train")
    assert [bad.row for bad in report.bad_rows] == list(range(1, MAX_BAD_ROWS_SHOWN + 1))
    assert report.skipped == {"empty_query": bad}


@pytest.mark.parametrize("limit, stops", [(0.24, True), (0.25, False), (0.26, False)])
def test_max_bad_fraction_is_the_share_of_rows_read_at_its_boundary(tmp_path, limit, stops):
    """1 bad row of 4 read is 25 % (33 % of the 3 kept): 0.25 passes, 0.24 stops."""
    path = _jsonl(tmp_path / "pairs.jsonl", [{"query": "q", "positive": "p"}] * 3 + [{"query": "", "positive": "p"}])
    if stops:
        with pytest.raises(DataError, match=r"pairs.jsonl, row 4: 1 of 4 rows of data.train are unusable"):
            load_examples(DataConfig(train=str(path), max_bad_fraction=limit), "train")
    else:
        assert len(load_examples(DataConfig(train=str(path), max_bad_fraction=limit), "train")[0]) == 3


def test_the_unusable_share_is_over_the_rows_read_with_records_found_bad_later():
    """What data.max_bad_fraction limits at load and in training (images that do not decode): skipped rows plus those
    found later, over every row read (kept, skipped, and those short of negatives), named sources summed."""
    from vembed.data.reports import DataReport, SourcesReport, unusable_share

    report = DataReport(split="train", files=["a.jsonl"], total=20, kept=16, skipped={"empty_query": 2}, short=2)
    assert unusable_share(report) == pytest.approx(2 / 20, abs=1e-12)
    assert unusable_share(report, 3) == pytest.approx(5 / 20, abs=1e-12)  # not 5 / 18 (kept + skipped) nor 5 / 16
    other = DataReport(split="train", files=["b.jsonl"], total=5, kept=5, source="b")
    both = SourcesReport("train", {"a": report, "b": other})
    assert both.total == 25 and unusable_share(both, 3) == pytest.approx(5 / 25, abs=1e-12)


def test_a_split_whose_rows_are_all_bad_raises(tmp_path):
    path = _jsonl(tmp_path / "pairs.jsonl", [{"query": "q", "positive": ""}])
    with pytest.raises(DataError, match="no usable rows"):
        load_examples(DataConfig(train=str(path), max_bad_fraction=1.0), "train")


def test_several_files_with_different_columns(tmp_path, json_reading):
    a = _jsonl(tmp_path / "d" / "a.jsonl", [{"query": "qa", "positive": "pa"}])
    _jsonl(tmp_path / "d" / "b.jsonl", [{"query": "qb", "positive": "pb", "label": "x"}])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    examples, report = load_examples(DataConfig(train=str(tmp_path / "d")), "train")
    assert [(e.query.text, e.label) for e in examples] == [("qa", None), ("qb", "x")]
    assert report.files == [str(a), str(tmp_path / "d" / "b.jsonl")]


def test_resolve_files_paths_globs_directories_and_lists(tmp_path):
    for name in ("b.jsonl", "a.csv", "c.parquet", "skip.txt"):
        (tmp_path / name).write_text("")
    found = resolve_files(str(tmp_path), "auto", key="data.train")
    assert found == [str(tmp_path / n) for n in ("a.csv", "b.jsonl", "c.parquet")]
    assert resolve_files(str(tmp_path / "*.jsonl"), "auto", "data.train") == [str(tmp_path / "b.jsonl")]
    assert resolve_files(str(tmp_path), "csv", "data.train") == [str(tmp_path / "a.csv")]
    both = [str(tmp_path / "b.jsonl"), str(tmp_path / "a.csv"), str(tmp_path / "b.jsonl")]
    assert resolve_files(both, "auto", "data.train") == [str(tmp_path / "b.jsonl"), str(tmp_path / "a.csv")]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("trian.jsonl", "did you mean train.jsonl"),
        ("*.parquet", "matched no files"),
        ("nodir/x.jsonl", "does not exist either"),
        ("empty", "has no .jsonl/.json/.csv/.parquet files"),
        ("train.txt", "cannot tell the format"),
    ],
)
def test_resolve_files_errors_name_the_key_and_the_fix(tmp_path, monkeypatch, value, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "train.txt").write_text("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError) as err:
        resolve_files(value, "auto", key="data.validation")
    assert err.value.key == "data.validation" and expected in str(err.value)


def test_check_recipe_reports_a_missing_training_file_by_key(tmp_path):
    from vembed.components import recipe_from_dict

    recipe = recipe_from_dict({"data": {"train": str(tmp_path / "nope.jsonl")}})
    with pytest.raises(RecipeError) as err:
        check_data_paths(recipe.data, ("train",))
    assert err.value.key == "data.train" and "not found" in str(err.value)


def test_unset_split_and_unparsable_file(tmp_path):
    with pytest.raises(RecipeError, match="data.validation"):
        load_examples(DataConfig(train="x"), "validation")
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"query": "a", "positive": "b"}\n\n{not json\n')
    with pytest.raises(DataError, match="cannot read as json: line 3 is not valid JSON") as err:
        load_examples(DataConfig(train=str(bad)), "train")
    assert (err.value.file, err.value.row) == (str(bad), 2)  # the 2nd record: rows are records, blank lines are not


def test_a_jsonl_row_is_named_by_its_record_number_whatever_blank_lines_precede_it(tmp_path):
    """One numbering for every message about a row: a row skipped by the checks and a line that does not parse."""
    path = tmp_path / "pairs.jsonl"
    path.write_text('\n{"query": "a", "positive": "b"}\n\n{"query": "", "positive": "c"}\n'
                    + "".join(f'{{"query": "q{i}", "positive": "p{i}"}}\n' for i in range(8)))
    _, report = load_examples(DataConfig(train=str(path), max_bad_fraction=0.5), "train")
    assert [(bad.row, bad.reason) for bad in report.bad_rows] == [(2, "empty_query")]
    path.write_text(path.read_text().replace('{"query": "", "positive": "c"}', "{broken"))
    with pytest.raises(DataError, match=r"pairs.jsonl, row 2: cannot read as json: line 4 is not valid JSON"):
        load_examples(DataConfig(train=str(path)), "train")


@pytest.mark.parametrize("layout", ["array", "columns", "lines with blanks"])
def test_json_layouts_read_the_same_examples(tmp_path, layout):
    path = tmp_path / "pairs.json"
    if layout == "array":
        path.write_text(json.dumps(ROWS, indent=2))
    elif layout == "columns":
        path.write_text(json.dumps({key: [row[key] for row in ROWS] for key in ROWS[0]}))
    else:
        path.write_text("\n" + "\n\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    examples, report = load_examples(DataConfig(train=str(path)), "train")
    assert [e.query.text for e in examples] == ["a red square", "a blue circle", "a green triangle"]
    assert [e.row for e in examples] == [1, 2, 3] and report.num_hard_negatives == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[{"query": "a", "positive": "b"},\n {"query": "c"', "cannot read as json: line 2"),
        ('{"query": ["a", "b"], "positive": ["c"]}', "columns have different lengths"),
        ('{"query": "a", "positive": "b"}\n["c", "d"]\n', "record 2 is a list, not an object"),
    ],
    ids=["broken array", "ragged columns", "not an object"],
)
def test_json_that_is_not_records_is_one_line_naming_the_file(tmp_path, text, expected):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DataError, match=expected) as err:
        load_examples(DataConfig(train=str(path)), "train")
    assert err.value.file == str(path)


def test_reading_json_lines_does_not_import_datasets(tmp_path):
    """`datasets` (with pandas and pyarrow) costs ~0.5 s of start-up; JSON Lines do not need it."""
    import subprocess
    import sys

    path = _jsonl(tmp_path / "pairs.jsonl", ROWS)
    code = ("import sys; from vembed.data.sources import load_examples; from vembed.recipe import DataConfig; "
            f"examples, _ = load_examples(DataConfig(train={str(path)!r}), 'train'); "
            "assert len(examples) == 3; "
            "print(sorted(m for m in ('datasets', 'pandas', 'pyarrow') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_hf_saved_dataset_with_embedded_images(tmp_path):
    import datasets
    from PIL import Image

    images = [Image.new("RGB", (4, 4), (i * 40, 0, 0)) for i in range(3)]
    table = datasets.Dataset.from_dict(
        {"query": ["a", "b", "c"], "positive_image": images},
        features=datasets.Features({"query": datasets.Value("string"), "positive_image": datasets.Image()}),
    )
    datasets.DatasetDict({"train": table, "validation": table.select([0])}).save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(train=str(tmp_path / "hf"), validation=str(tmp_path / "hf"), format="hf")
    examples, report = load_examples(cfg, "train")
    assert report.kept == 3
    from vembed.data.images import load_image

    decoded = load_image(examples[1].positive.image)
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (40, 0, 0)
    examples, _ = load_examples(cfg, "validation")
    assert len(examples) == 1
    with pytest.raises(RecipeError, match="format 'hf'"):
        resolve_files(str(tmp_path / "missing"), "hf", key="data.train")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_image_cells_may_list_several_images_per_side(tmp_path, fmt):
    import pandas as pd

    for name in ("a", "b", "c", "d"):
        _png(tmp_path / f"{name}.png")
    rows = [
        {"query": "two pictures", "query_image": ["a.png", "b.png"], "positive_image": ["c.png"],
         "negatives": ["n1", "n2"], "negative_images": [["a.png", "d.png"], ["c.png"]]},
        {"query": "one picture", "query_image": ["a.png", "gone.png"], "positive": "p",
         "negatives": ["n1", "n2"], "negative_images": [["a.png"], ["b.png"]]},  # row 2: an image is missing
    ]
    if fmt == "jsonl":
        path = _jsonl(tmp_path / "pairs.jsonl", rows)
    elif fmt == "csv":  # a CSV cell holds a list as JSON
        frame = pd.DataFrame([{key: json.dumps(value) if isinstance(value, list) else value
                               for key, value in row.items()} for row in rows])
        path = tmp_path / "pairs.csv"
        frame.to_csv(path, index=False)
    else:
        path = tmp_path / "pairs.parquet"
        pd.DataFrame(rows).to_parquet(path)
    examples, report = load_examples(DataConfig(train=str(path), max_bad_fraction=0.5), "train")
    (example,) = examples
    img = lambda name: str(tmp_path / f"{name}.png")  # noqa: E731
    assert example.query.image == [img("a"), img("b")]
    assert example.positive.image == img("c")  # a list of one is that image: single-image models read it
    assert [n.image for n in example.negatives] == [[img("a"), img("d")], img("c")]
    assert report.skipped == {"missing_image": 1} and report.bad_rows[0].row == 2
    assert "gone.png" in report.bad_rows[0].detail


def test_hf_list_of_images_column_gives_one_side_several_embedded_images(tmp_path):
    import datasets
    from PIL import Image

    from vembed.data.images import load_image

    red, green = Image.new("RGB", (4, 4), (200, 0, 0)), Image.new("RGB", (4, 4), (0, 200, 0))
    table = datasets.Dataset.from_dict(
        {"query": ["two", "one"], "query_image": [[red, green], [green]], "positive": ["p", "q"]},
        features=datasets.Features({"query": datasets.Value("string"), "query_image": datasets.List(datasets.Image()),
                                    "positive": datasets.Value("string")}),
    )
    table.save_to_disk(str(tmp_path / "hf"))
    examples, _ = load_examples(DataConfig(train=str(tmp_path / "hf"), format="hf"), "train")
    two, one = examples[0].query.image, examples[1].query.image
    assert [load_image(image).getpixel((0, 0)) for image in two] == [(200, 0, 0), (0, 200, 0)]
    assert load_image(one).getpixel((0, 0)) == (0, 200, 0)


# --- rows checked column by column, records made on fetch -------------------------------------------------------------

TRICKY_ROWS = [
    {"query": "fine", "positive": "doc", "negatives": ["a", "", "b"]},  # 1: an empty negative is not one
    {"query": "\u3000 \t", "positive": "doc"},  # 2: only (unicode) whitespace: empty query
    {"query": None, "query_image": "ok.png", "positive": "doc"},  # 3: an image query
    {"query": "q", "positive": "", "positive_image": ["ok.png", "ok.png"]},  # 4: two images
    {"query": "q", "positive": None},  # 5: empty positive
    {"query": "q", "query_image": "gone.png", "positive": ""},  # 6: missing image wins over empty positive
    {"query": "q", "positive": "p", "negatives": ["n1", "n2"], "negative_images": [None, "gone.png"]},  # 7
    {"query": 7, "positive": 3.0, "negatives": [None, "x"]},  # 8: numbers are not text (parquet: written as text)
    {"query": "", "positive": "p", "query_image": ""},  # 9: empty query
    {"query": "q", "positive": "p", "negatives": "just one"},  # 10
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_column_checks_agree_with_the_row_reader_on_every_row(tmp_path, fmt, json_reading):
    """The vectorised checks (what is skipped, usable negatives, modalities, images) match RowReader row by row."""
    import pandas as pd

    from vembed.data.checks import IMAGE, REASONS, TEXT, check_rows
    from vembed.data.reader import RowReader, Skipped
    from vembed.data.paths import builder_for
    from vembed.data.tables import _undecoded_images, json_parts, read_table

    _png(tmp_path / "ok.png")
    if fmt == "jsonl":
        path = _jsonl(tmp_path / "rows.jsonl", TRICKY_ROWS)
    else:
        path = tmp_path / "rows.parquet"
        frame = pd.DataFrame([{**row, "query": None if row.get("query") is None else str(row["query"]),
                               "positive": None if row.get("positive") is None else str(row["positive"]),
                               "negatives": row.get("negatives") if isinstance(row.get("negatives"), list)
                               else [row["negatives"]] if row.get("negatives") else None} for row in TRICKY_ROWS])
        frame.to_parquet(path)
    columns = DataConfig().columns.model_dump()
    table = read_table(str(path), builder_for(str(path)), "train")
    table = _undecoded_images(table.select_columns([c for c in columns.values() if c in table.column_names]), [])
    reader = RowReader(str(path), builder_for(str(path)), columns, str(tmp_path),
                       json_parts=json_parts(table, columns))  # mixed list/string negatives: datasets stores JSON
    checks = check_rows(table, reader)
    for position in range(len(TRICKY_ROWS)):
        if hasattr(table, "records"):
            raw = {part: table.records[position].get(name) for part, name in columns.items()}
        else:
            raw = {part: table[position].get(name) for part, name in columns.items()}
        try:
            example = reader.example(raw, position + 1)
        except Skipped as skipped:
            assert REASONS[checks.reason[position]] == skipped.reason, f"row {position + 1}"
            continue
        assert checks.reason[position] == 0, f"row {position + 1}: checks say {REASONS[checks.reason[position]]}"
        assert checks.negatives[position] == len(example.negatives), f"row {position + 1}"
        sides = [example.query, example.positive]
        bits = (TEXT if any(side.text for side in sides) else 0) | (IMAGE if any(side.images for side in sides) else 0)
        assert checks.modalities[position] == bits, f"row {position + 1}"
        most = max(len(side.images) for side in sides + example.negatives)
        assert checks.max_images[position] == most, f"row {position + 1}"
    assert sorted(REASONS[code] for code in checks.reason if code) == sorted(
        ["empty_query", "empty_positive", "missing_image", "missing_image", "empty_query"]
        + (["bad_text"] if fmt == "jsonl" else []))


def test_large_files_are_memory_mapped_and_records_are_made_on_fetch(tmp_path, monkeypatch):
    import datasets

    from vembed.data.rows import PairRows
    from vembed.data.sources import load_rows

    monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)
    path = _jsonl(tmp_path / "pairs.jsonl", ROWS * 4)
    rows, report = load_rows(DataConfig(train=str(path)), "train")
    assert isinstance(rows, PairRows) and len(rows) == 12 and report.kept == 12
    (part,) = rows.parts
    assert isinstance(part.table, datasets.Dataset) and part.table.cache_files  # on disk, mapped
    assert rows[4].query.text == "a blue circle" and rows[-1].positive.text == "doc three"
    assert [n.text for n in rows[1].negatives] == ["n3", "n4"]  # cut to the split's count on fetch


def test_a_second_load_maps_the_cached_checks_instead_of_checking_again(tmp_path, monkeypatch):
    from vembed.data import checks
    from vembed.data.sources import load_rows

    monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)
    path = _jsonl(tmp_path / "pairs.jsonl", ROWS + [{"query": "", "positive": "p"}])
    calls = []
    original = checks.BatchChecker.__call__
    monkeypatch.setattr(checks.BatchChecker, "__call__", lambda self, batch: calls.append(1) or original(self, batch))
    config = DataConfig(train=str(path), max_bad_fraction=0.5)
    first, report = load_rows(config, "train")
    assert calls and report.skipped == {"empty_query": 1}
    calls.clear()
    second, again = load_rows(config, "train")
    assert calls == [] and again.to_dict() == report.to_dict() and len(second) == len(first) == 3
    # a changed file is checked again
    _jsonl(path, ROWS)
    third, _ = load_rows(DataConfig(train=str(path)), "train")
    assert calls and len(third) == 3


@pytest.mark.slow
def test_one_rank_per_node_builds_the_cache_the_others_wait_and_map_it(tmp_path):
    """Two processes (local ranks 0 and 1) load the same large file at once: one checks the rows, the other waits on
    the node's file lock and finds the checks built."""
    import subprocess
    import sys

    path = _jsonl(tmp_path / "pairs.jsonl", [{"query": f"q{i}", "positive": f"p{i}"} for i in range(3000)])
    code = (
        "import sys, time, vembed.data.sources as s, vembed.data.tables as t, vembed.data.checks as c; "
        "t.SMALL_JSON_BYTES = 0; calls = []; "
        "original = c.BatchChecker.__call__; "  # slow checks: the other rank surely arrives while they run
        "c.BatchChecker.__call__ = lambda self, batch: calls.append(1) or time.sleep(3) or original(self, batch); "
        "from vembed.recipe import DataConfig; "
        f"rows, _ = s.load_rows(DataConfig(train={str(path)!r}), 'train'); "
        "print(len(rows), len(calls))"
    )
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    ranks = [subprocess.Popen([sys.executable, "-c", code], env={**env, "LOCAL_RANK": str(rank)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    results = []
    for process in ranks:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        results.append(tuple(int(x) for x in out.split()))
    assert sorted(results) == [(3000, 0), (3000, 1)]  # both have every row; exactly one checked them


def test_image_rows_are_checked_in_worker_processes_with_the_same_result(tmp_path, monkeypatch):
    """Cells that need Python per row (image paths) go to `Dataset.map(num_proc=...)` workers on large tables; the
    verdicts and the cache are those of the in-process checks."""
    from vembed.data import checks
    from vembed.data.sources import load_rows

    _png(tmp_path / "ok.png")
    rows = [{"query": f"q{i}", "positive_image": "ok.png" if i % 7 else "gone.png"} for i in range(40)]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    config = DataConfig(train=str(path), max_bad_fraction=0.2)
    monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)
    in_process, report = load_rows(config, "train")
    used = []
    original = checks._check_processes
    monkeypatch.setattr(checks, "MIN_ROWS_FOR_PROCESSES", 10)
    monkeypatch.setattr(checks.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(checks, "_check_processes", lambda table, reader: used.append(original(table, reader)) or 2)
    monkeypatch.setattr(checks, "CHECKS_VERSION", checks.CHECKS_VERSION + 1000)  # not the cached in-process run
    in_workers, again = load_rows(config, "train")
    assert used == [2]
    assert again.to_dict() == report.to_dict() and report.skipped == {"missing_image": 6}
    assert [e.query.text for e in in_workers] == [e.query.text for e in in_process]
def test_numbers_or_lists_where_text_is_expected_are_bad_rows_not_text(tmp_path):
    """str() used to turn them into "12" or "['a', 'b']" and train on that."""
    rows = [{"query": "a red square", "positive": "doc one"}, {"query": 12, "positive": "doc two"},
            {"query": "a blue circle", "positive": ["a", "b"]}]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError, match="2 of 3 rows .* unusable \\(2 bad_text.*query cell holds int 12, not text"):
        load_examples(DataConfig(train=str(path)), "train")
    examples, report = load_examples(DataConfig(train=str(path), max_bad_fraction=1.0), "train")
    assert [e.query.text for e in examples] == ["a red square"] and report.skipped == {"bad_text": 2}
    assert "positive cell holds list ['a', 'b']" in str(report.bad_rows[1])


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_column_of_numbers_mapped_as_text_is_one_line(tmp_path, fmt):
    rows = [{"query": i, "positive": f"doc {i}"} for i in range(5)]
    path = _write(tmp_path, fmt, rows) if fmt == "parquet" else tmp_path / "pairs.csv"
    if fmt == "csv":
        path.write_text("query,positive\n" + "".join(f"{i},doc {i}\n" for i in range(5)))
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(train=str(path)), "train")
    assert "all 5 skipped (5 bad_text)" in str(err.value) and "data.columns" in str(err.value)


def test_an_empty_file_is_one_error_without_a_warning_first(tmp_path, caplog):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="has no rows"):
        load_examples(DataConfig(train=str(empty)), "train")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # Beside a file with rows, an empty one is still worth a warning.
    load_examples(DataConfig(train=[str(empty), str(_write(tmp_path, "jsonl"))]), "train")
    assert [r for r in caplog.records if "no rows, ignored" in r.getMessage()]


def test_a_truncated_parquet_file_is_one_line_with_no_library_log_before_it(tmp_path):
    import logging

    whole = _write(tmp_path, "parquet").read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole[: len(whole) // 2])
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # datasets' loggers do not reach pytest's caplog
    logging.getLogger("datasets").addHandler(handler)
    try:
        with pytest.raises(DataError, match="cut.parquet: cannot read as parquet"):
            load_examples(DataConfig(train=str(cut)), "train")
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]  # "Failed to read schema ..."
