"""vembed/classification/labelled.py: a `datasets` table (a save_to_disk folder, a Parquet file as `datasets` writes it)
with an Image column and a label column gives the records its ImageFolder tree gives (labels, pixels), without decoding
an image up front; bad cells are skipped and counted, above data.max_bad_fraction the read stops naming the row; the
image cache applies to labelled images as to pair data (a second open reads it, a changed table rebuilds it)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from vembed.classification.labelled import read_labelled_images
from vembed.data.images import load_image
from vembed.errors import DataError

CLASSES = ["zero", "one", "two"]  # the ClassLabel's id order, not sorted: ids must follow the feature's names


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """The same digits as an ImageFolder tree (`tree/`), a save_to_disk folder (`saved/`) holding the PNG files'
    bytes, and that table as Parquet (`digits.parquet`)."""
    from training_digits import write_digits

    root = tmp_path_factory.mktemp("labelled")
    rows = write_digits(root / "tree", per_class=4)
    write_dataset(root, [(root / "tree" / path).read_bytes() for path, _ in rows],
                  [CLASSES.index(label) for _, label in rows], parquet=True)
    return root


def write_dataset(root: Path, images: list, labels: list, label_feature=None, name: str = "saved",
                  parquet: bool = False, label_column: str = "label") -> Path:
    """A `datasets` table of embedded image bytes and labels (a ClassLabel of CLASSES unless `label_feature`),
    saved as a folder `root/name` (and with `parquet`, as `root/name.parquet`)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(),
                                  label_column: label_feature or datasets.ClassLabel(names=CLASSES)})
    cells = [{"bytes": image, "path": None} for image in images]
    table = datasets.Dataset.from_dict({"image": cells, label_column: labels}, features=features)
    table.save_to_disk(str(root / name))
    if parquet:
        table.to_parquet(str(root / f"{name}.parquet"))
    return root / name


def records(data) -> list[tuple[str, bytes]]:
    """(class name, decoded pixels) of every image, sorted: the layouts list the same images in different orders."""
    return sorted((data.names[label], np.asarray(load_image(data.image(i))).tobytes())
                  for i, label in enumerate(data.labels))


def test_a_datasets_folder_and_its_parquet_give_the_image_folder_records_without_decoding_up_front(digits,
                                                                                                    monkeypatch):
    from PIL import Image

    tree = read_labelled_images(str(digits / "tree"), "data.train")
    decoded = []
    real_load = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(1) or real_load(self))
    saved = read_labelled_images(str(digits / "saved"), "data.train")
    parquet = read_labelled_images(str(digits / "saved.parquet"), "data.train")
    assert not decoded  # headers read, no pixels
    assert saved.names == parquet.names == CLASSES  # the ClassLabel's names, in its id order
    assert len(saved) == len(parquet) == len(tree) == 12 and not saved.skipped
    assert isinstance(saved.image(0), Image.Image) and not decoded  # opened lazily
    assert records(saved) == records(parquet) == records(tree)


def test_string_and_integer_label_columns_name_the_classes_as_a_csv_does(digits, tmp_path):
    import datasets

    images = [(digits / "tree" / name / f).read_bytes() for name in ("zero", "one")
              for f in sorted(p.name for p in (digits / "tree" / name).iterdir())[:2]]
    write_dataset(tmp_path, images, ["zero", "zero", "one", "one"], datasets.Value("string"), "named")
    named = read_labelled_images(str(tmp_path / "named"), "data.train")
    assert named.names == ["one", "zero"] and named.labels == [1, 1, 0, 0]  # sorted, as a CSV's names
    write_dataset(tmp_path, images, [0, 0, 2, 2], datasets.Value("int64"), "ids")
    ids = read_labelled_images(str(tmp_path / "ids"), "data.train", num_labels=3)
    assert ids.names == ["0", "1", "2"] and ids.labels == [0, 0, 2, 2]


def write_parquet(file: Path, cells: list[dict], labels: list[int]) -> Path:
    """{bytes, path} image cells as `datasets` stores them, written by pyarrow alone (no features metadata): how a
    table of image paths looks (save_to_disk and to_parquet embed the files' bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"image": pa.array(cells, type=kind), "label": pa.array(labels, pa.int64())}), file)
    return file


def _digit_bytes(digits: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted((digits / "tree" / "zero").iterdir())]


@pytest.mark.parametrize("case,message", [
    ("not_images", r"saved: 2 of 6 rows have no image file or no readable image .*max_bad_fraction=0.05.*first: "
                   r"row 1: column 'image': embedded bytes are not an image"),
    ("missing_files", r"table.parquet: 2 of 6 rows .*first: row 2: column 'image': image not found: "
                      r".*saved/gone\.png"),
    ("no_label_column", r"saved: has no 'label' column \(columns: image, kind\); labelled images need 'image' "
                        r"and 'label' \(data.columns.label\)"),
    ("unlabelled_row", r"saved, row 3: label -1 is outside the classes 0..2 of column 'label' \(its ClassLabel "
                       r"names\)"),
    ("label_range", r"saved, row 2: label 7 is outside the classes 0..2; fix the label or the number of classes"),
])
def test_bad_datasets_cells_stop_the_read_naming_the_row(digits, tmp_path, case, message):
    import datasets

    good = _digit_bytes(digits)
    labels, feature, path = [0, 1, 2, 0, 1, 2], None, None
    images = list(good[:4]) + list(good[:2])
    if case == "not_images":
        images[0], images[3] = b"not an image", b"\x89PNG but not really"
    elif case == "missing_files":  # a Parquet table of paths, relative to its folder or absolute
        cells = [{"bytes": image, "path": None} for image in images]
        cells[1], cells[4] = {"bytes": None, "path": "gone.png"}, {"bytes": None, "path": "/nowhere/gone.png"}
        (tmp_path / "saved").mkdir()
        path = write_parquet(tmp_path / "saved" / "table.parquet", cells, labels)
    elif case == "unlabelled_row":
        labels[2] = -1
    elif case == "label_range":
        labels[1], feature = 7, datasets.Value("int64")
    if path is None:
        path = write_dataset(tmp_path, images, labels, feature,
                             label_column="kind" if case == "no_label_column" else "label")
    with pytest.raises(DataError, match=message):
        read_labelled_images(str(path), "data.train", num_labels=3)


def test_a_few_bad_cells_are_skipped_and_counted_below_max_bad_fraction(digits, tmp_path):
    good = _digit_bytes(digits)
    one = sorted((digits / "tree" / "one").iterdir())[0].name
    cells = ([{"bytes": b"junk", "path": None}, {"bytes": None, "path": f"one/{one}"}]
             + [{"bytes": image, "path": None} for image in good[1:4]])
    file = write_parquet(tmp_path / "table.parquet", cells, [0, 1, 0, 0, 0])
    data = read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"), max_bad_fraction=0.25)
    assert len(data) == 4 and data.num_skipped == 1 and data.skipped[0]["row"] == 1
    # a {path} cell is a file (relative to data.image_root, as in a CSV); integer labels are ids
    assert data.paths[0] == str(digits / "tree" / "one" / one) and data.labels == [1, 0, 0, 0]
    assert "skipped 1 row(s), first row 1: column 'image': embedded bytes are not an image" in data.summary()


def _vit_processor():
    from transformers import ViTImageProcessorPil

    return ViTImageProcessorPil(size={"height": 16, "width": 16})


def test_the_image_cache_holds_embedded_images_and_a_second_open_reads_it(digits, tmp_path, monkeypatch):
    from vembed.classification import labelled
    from vembed.data.image_cache import CachedPixels, open_image_cache

    decodes = []
    monkeypatch.setattr(labelled, "load_image", lambda image: decodes.append(1) or load_image(image))
    processor = _vit_processor()

    def opened(path: Path):
        data = read_labelled_images(str(path), "data.train")
        data.cache = open_image_cache(sorted(set(data.paths)), processor, tmp_path / "cache", load=data.load,
                                      stamp=data.stamp)
        return data

    first = opened(digits / "saved")
    assert len(decodes) == 12 and first.cache.build_seconds is not None and len(first.cache) == 12
    second = opened(digits / "saved")
    assert len(decodes) == 12 and second.cache.build_seconds is None and second.cache.file == first.cache.file
    assert isinstance(second.image(0), CachedPixels)
    expected = processor(images=[load_image(first.embedded.open(first.paths[0]))], do_rescale=False,
                         do_normalize=False)["pixel_values"][0]
    assert np.array_equal(second.image(0).pixels, expected)
    # A table saved again in place with other images: its files changed, so a new cache, as for a changed file.
    before = opened(write_dataset(tmp_path, _digit_bytes(digits)[:3], [0, 1, 2]))
    after = opened(write_dataset(tmp_path, _digit_bytes(digits)[1:4], [0, 1, 2]))
    assert before.paths == after.paths and after.cache.file != before.cache.file
    assert np.array_equal(after.image(0).pixels, before.image(1).pixels)


def test_images_that_only_the_cache_build_finds_broken_are_skipped_and_counted(digits, tmp_path):
    """A truncated PNG passes the header check; decoding every image for the cache finds it, before step 1."""
    from vembed.classification.task import with_image_cache
    from vembed.components import model_class, recipe_from_dict

    good = _digit_bytes(digits)
    truncated = good[0][: len(good[0]) // 2]
    write_dataset(tmp_path, [truncated] + good[1:4], [0, 1, 2, 0])
    raw = {"model_type": "vision", "loss_type": "cross_entropy", "num_labels": 3, "output_dir": str(tmp_path / "run"),
           "model_config": {"model_type": "vit", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
           "data": {"train": str(tmp_path / "saved"), "image_cache_dir": str(tmp_path / "cache"),
                    "max_bad_fraction": 0.25}}
    recipe = recipe_from_dict(raw)
    adapter = model_class(recipe).from_recipe(recipe)
    data = with_image_cache(read_labelled_images(str(tmp_path / "saved"), "data.train"), adapter, recipe)
    assert len(data) == 3 and data.num_skipped == 1 and data.skipped[0]["row"] == 1
    assert "cannot decode" in data.skipped[0]["reason"] and data.labels == [1, 2, 0]
    strict = recipe_from_dict({**raw, "data": {**raw["data"], "max_bad_fraction": 0.05}})
    with pytest.raises(DataError, match=r"saved: 1 of 4 rows have no image file or no readable image \(found "
                                        r"decoding every image for the image cache\).*first: row 1: cannot decode"):
        with_image_cache(read_labelled_images(str(tmp_path / "saved"), "data.train"), adapter, strict)


def test_the_image_folder_records_go_through_the_cache_too(digits, tmp_path):
    from vembed.data.image_cache import CachedPixels, open_image_cache

    data = read_labelled_images(str(digits / "tree"), "data.train")
    data.cache = open_image_cache(sorted(data.paths), _vit_processor(), tmp_path / "cache", load=data.load,
                                  stamp=data.stamp)
    assert all(isinstance(data.image(i), CachedPixels) for i in range(len(data)))
    # files keep the pair data's key: the same cache file as the pair data's call (no load/stamp) opens
    assert open_image_cache(sorted(data.paths), _vit_processor(), tmp_path / "cache").build_seconds is None


def test_an_embedded_image_opened_lazily_decodes_to_the_file_s_pixels(digits):
    from PIL import Image

    data = read_labelled_images(str(digits / "saved"), "data.train")
    first = data.image(0)
    raw = Image.open(io.BytesIO(_digit_bytes(digits)[0]))
    assert np.array_equal(np.asarray(load_image(first)), np.asarray(load_image(raw)))


# --- rows numbered as pair files number them: data rows from 1, a CSV's header not counted ---------------------------
def _labelled_csv(tmp_path: Path, digits: Path, labels: list[str], images: list[str] | None = None) -> Path:
    """A CSV of image paths (relative to the digits tree) and labels; one row per label."""
    zero = sorted(p.name for p in (digits / "tree" / "zero").iterdir())
    images = images if images is not None else [f"zero/{zero[i % len(zero)]}" for i in range(len(labels))]
    file = tmp_path / "labelled.csv"
    file.write_text("image,label\n" + "".join(f"{image},{label}\n" for image, label in zip(images, labels)))
    return file


def test_a_csv_label_outside_the_classes_names_its_data_row(digits, tmp_path):
    file = _labelled_csv(tmp_path, digits, ["0", "1", "2", "7"])  # the 4th data row (the file's 5th line)
    with pytest.raises(DataError, match=r"labelled.csv, row 4: label 7 is outside the classes 0..2"):
        read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"), num_labels=3)


def test_a_csv_label_of_no_training_class_names_its_data_row(digits, tmp_path):
    file = _labelled_csv(tmp_path, digits, ["zero", "one", "two"])
    with pytest.raises(DataError, match=r"labelled.csv, row 2: label 'one' is not one of the training classes"):
        read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"), names=["zero", "two"])


def test_a_csv_row_without_its_image_is_counted_under_its_data_row(digits, tmp_path):
    file = _labelled_csv(tmp_path, digits, ["0", "1", "0", "1"])
    file.write_text(file.read_text().replace("zero/", "gone/", 1))  # the first data row's image is not there
    data = read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"), max_bad_fraction=0.25)
    assert data.skipped[0]["row"] == 1 and "first row 1: image not found" in data.summary()


def test_images_found_broken_later_are_counted_under_their_own_rows(digits, tmp_path):
    """Decoding every image (the image cache) moves an image to `skipped` under the row it was read from, not its
    position among the images kept."""
    zero = sorted(p.name for p in (digits / "tree" / "zero").iterdir())
    images = ["gone.png", f"zero/{zero[0]}", f"zero/{zero[1]}", f"zero/{zero[2]}"]
    file = _labelled_csv(tmp_path, digits, ["0", "0", "0", "0"], images)
    data = read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"), max_bad_fraction=0.5)
    data.without({str(digits / "tree" / "zero" / zero[1]): "cannot decode"})
    assert data.skipped == [{"row": 1, "reason": f"image not found: {digits / 'tree' / 'gone.png'}"},
                            {"row": 3, "reason": "cannot decode"}]
    assert len(data) == 2 and data.labels == [0, 0]
    saved = read_labelled_images(str(digits / "saved"), "data.train")  # embedded images: the same numbering
    saved.without({saved.paths[2]: "cannot decode"})
    assert saved.skipped == [{"row": 3, "reason": "cannot decode"}]


# --- data.max_bad_fraction over the rows read, at its boundary ------------------------------------------------------
@pytest.mark.parametrize("limit, stops", [(0.24, True), (0.25, False), (0.26, False)])
def test_max_bad_fraction_is_the_share_of_rows_read_at_the_boundary(digits, tmp_path, limit, stops):
    """1 of 4 rows skipped is 25% of the rows read (33% of the 3 kept): a limit of 0.25 passes, 0.24 stops."""
    zero = sorted(p.name for p in (digits / "tree" / "zero").iterdir())
    file = _labelled_csv(tmp_path, digits, ["0", "0", "0", "0"], ["gone.png"] + [f"zero/{name}" for name in zero[:3]])
    read = lambda: read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"),  # noqa: E731
                                        max_bad_fraction=limit)
    if stops:
        with pytest.raises(DataError, match=r"labelled.csv: 1 of 4 rows have no image file .* first: row 1: image "
                                            r"not found"):
            read()
    else:
        assert len(read()) == 3


@pytest.mark.parametrize("limit, stops", [(0.24, True), (0.25, False)])
def test_max_bad_fraction_after_decoding_counts_the_rows_read_at_the_boundary(digits, limit, stops):
    """Images found broken when decoded (image cache) count over the rows read too: 1 of 4, whatever the layout."""
    for path in (digits / "tree", digits / "saved"):
        data = read_labelled_images(str(path), "data.train")  # 12 images, none skipped yet
        data.without({key: "cannot decode" for key in data.paths[:3]})
        if stops:
            with pytest.raises(DataError, match=r"3 of 12 rows have no image file or no readable image"):
                data.check_bad_fraction(limit)
        else:
            data.check_bad_fraction(limit)


# --- label ranges at their boundary: the last class is one, one past it is not -------------------------------------
@pytest.mark.parametrize("label, refused", [(2, False), (3, True), (-1, True)])
def test_a_classlabel_id_at_the_edge_of_its_names(digits, tmp_path, label, refused):
    """A Parquet file whose schema declares a ClassLabel of CLASSES (as `datasets` writes it) but written by another
    tool: nothing stopped an id past the names from being stored."""
    import json

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = [{"bytes": image, "path": None} for image in _digit_bytes(digits)[:3]]
    table = pa.table({"image": pa.array(cells, type=kind), "label": pa.array([0, 1, label], pa.int64())})
    path = tmp_path / "ids.parquet"
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features":
                                                                                      features.to_dict()}})}), path)
    if refused:
        with pytest.raises(DataError, match=rf"ids.parquet, row 3: label {label} is outside the classes 0..2 of "
                                            "column 'label'"):
            read_labelled_images(str(path), "data.train")
    else:
        assert read_labelled_images(str(path), "data.train").labels == [0, 1, 2]


@pytest.mark.parametrize("label, refused", [("2", False), ("3", True)])
def test_an_integer_csv_label_at_the_edge_of_num_labels(digits, tmp_path, label, refused):
    file = _labelled_csv(tmp_path, digits, ["0", "1", label])
    read = lambda: read_labelled_images(str(file), "data.train", image_root=str(digits / "tree"),  # noqa: E731
                                        num_labels=3)
    if refused:
        with pytest.raises(DataError, match=rf"labelled.csv, row 3: label {label} is outside the classes 0..2"):
            read()
    else:
        assert read().labels == [0, 1, 2]
