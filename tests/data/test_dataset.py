"""vembed/data/dataset.py (and images.py): decoding on fetch, corrupt images substituted deterministically."""

from __future__ import annotations

import pytest

from vembed.data.dataset import PairDataset
from vembed.data.images import load_image
from vembed.data.records import Example, Side
from vembed.errors import DataError


def _png(path, colour):
    from PIL import Image

    Image.new("RGB", (4, 4), colour).save(path)
    return str(path)


def _corrupt(path):
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)  # a PNG signature, then garbage
    return str(path)


def _example(i, image):
    negatives = [Side(text="n0"), Side(text="n1")]
    return Example(Side(text=f"q{i}"), Side(image=image), negatives, row=i + 1, source="pairs.jsonl")


def test_items_have_decoded_rgb_images_and_the_stored_records_stay_paths(tmp_path):
    from PIL import Image

    examples = [_example(i, _png(tmp_path / f"{i}.png", (i * 50, 0, 0))) for i in range(3)]
    dataset = PairDataset(examples, num_negatives=1)
    item = dataset[1]
    assert isinstance(item.positive.image, Image.Image) and item.positive.image.mode == "RGB"
    assert item.positive.image.getpixel((0, 0)) == (50, 0, 0)
    assert item.query.text == "q1" and [n.text for n in item.negatives] == ["n0"]
    assert (item.row, item.source) == (2, "pairs.jsonl")
    assert isinstance(examples[1].positive.image, str) and len(examples[1].negatives) == 2
    assert len(dataset) == 3 and dataset.decode_failures == 0


def test_a_corrupt_image_is_replaced_by_the_next_good_record_and_counted(tmp_path):
    paths = [
        _png(tmp_path / "0.png", (0, 0, 0)),
        _corrupt(tmp_path / "1.png"),
        _corrupt(tmp_path / "2.png"),
        _png(tmp_path / "3.png", (3, 0, 0)),
    ]
    dataset = PairDataset([_example(i, p) for i, p in enumerate(paths)], num_negatives=0)
    assert dataset[1].query.text == "q3"
    assert dataset.decode_failures == 2
    assert dataset[2].query.text == "q3"  # the same substitute every time, without decoding again
    assert dataset.decode_failures == 2
    assert [dataset[i].query.text for i in (0, 3)] == ["q0", "q3"]


def test_substitution_wraps_around_and_fails_when_nothing_decodes(tmp_path):
    good = _png(tmp_path / "good.png", (1, 2, 3))
    bad = _corrupt(tmp_path / "bad.png")
    dataset = PairDataset([_example(0, good), _example(1, bad)])
    assert dataset[1].query.text == "q0"
    hopeless = PairDataset([_example(0, bad), _example(1, bad)])
    with pytest.raises(DataError, match="none of the 2 records") as err:
        hopeless[1]
    assert (err.value.file, err.value.row) == ("pairs.jsonl", 2)


def test_skipped_records_are_named_a_few_times_then_only_counted(tmp_path, caplog):
    """64 corrupt rows printed 64 "skipping" lines before the run's one error line."""
    from vembed.data.dataset import SKIPS_SHOWN

    good = _png(tmp_path / "good.png", (1, 2, 3))
    examples = [_example(i, _corrupt(tmp_path / f"{i}.png")) for i in range(20)] + [_example(20, good)]
    dataset = PairDataset(examples)
    with caplog.at_level("WARNING", logger="vembed.data.dataset"):
        for index in range(len(dataset)):
            dataset[index]
    lines = [record.getMessage() for record in caplog.records]
    assert dataset.decode_failures == 20 and len(lines) == SKIPS_SHOWN + 1
    assert lines[0].startswith("skipping pairs.jsonl, row 1: ") and "without a line each" in lines[-1]


def test_too_few_negatives_for_the_dataset_is_an_error():
    with pytest.raises(DataError, match="pairs.jsonl, row 1: record has 2 hard negatives, the dataset needs 3"):
        PairDataset([_example(0, None)], num_negatives=3)
    assert len(PairDataset([_example(0, None)], num_negatives=2).examples[0].negatives) == 2  # exactly enough


def test_load_image_converts_modes_and_names_bad_files(tmp_path):
    from PIL import Image

    Image.new("L", (3, 3), 7).save(tmp_path / "gray.png")
    Image.new("RGBA", (3, 3), (1, 2, 3, 0)).save(tmp_path / "alpha.png")
    assert load_image(tmp_path / "gray.png").getpixel((0, 0)) == (7, 7, 7)
    assert load_image(str(tmp_path / "alpha.png")).mode == "RGB"
    assert load_image(Image.new("P", (2, 2))).mode == "RGB"
    with pytest.raises(DataError, match="cannot decode") as err:
        load_image(_corrupt(tmp_path / "bad.png"))
    assert err.value.file == str(tmp_path / "bad.png")
    with pytest.raises(DataError, match="not found"):
        load_image(tmp_path / "missing.png")


def test_decode_counts_reach_the_training_process_from_dataloader_workers(tmp_path):
    """Workers hold their own copy of the dataset; their failures used to be lost (the loop saw 0 with workers)."""
    from torch.utils.data import DataLoader

    examples = [_example(i, _corrupt(tmp_path / f"{i}.png") if i % 4 == 0 else _png(tmp_path / f"{i}.png", (i, 0, 0)))
                for i in range(16)]
    dataset = PairDataset(examples)
    for _ in DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=list):
        pass
    counts = dataset.decode_counts()
    assert (counts.fetched, counts.replaced) == (16, 4)
    assert counts.first_bad is not None and counts.first_bad % 4 == 0
    assert dataset.decode_failures == 0  # the training process itself decoded nothing
