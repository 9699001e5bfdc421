"""vembed/data/image_cache.py: images resized once into a mapped file give the processor's pixel values bit for bit;
a changed file or processor setting rebuilds it, two ranks build it once, an interrupted build is never read, and
undecodable images are skipped and counted as without it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_on_ranks

from vembed.data import image_cache as ic
from vembed.data.dataset import PairDataset
from vembed.data.images import load_image
from vembed.data.records import Example, Side
from vembed.models.batch import PIXEL_VALUES, make_batch


def _images(folder: Path) -> list[str]:
    """Images of uneven sizes and modes (RGB, RGBA, greyscale, palette), so resize and crop do real work."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    draw = np.random.default_rng(0)
    paths = []
    for i, (size, mode) in enumerate([((40, 50), "RGB"), ((61, 33), "RGBA"), ((32, 32), "L"), ((90, 70), "P"),
                                      ((17, 29), "RGB"), ((50, 40), "RGB")]):
        pixels = draw.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
        image = Image.fromarray(pixels, "RGBA").convert(mode)
        paths.append(str(folder / f"{i}.png"))
        image.save(paths[-1])
    return sorted(paths)


def _processors() -> dict[str, object]:
    from transformers import SiglipImageProcessorPil, ViTImageProcessorPil

    from vembed.models.hf import clip_image_processor

    return {"clip": clip_image_processor(32),  # shortest edge, then centre crop
            "siglip": SiglipImageProcessorPil(size={"height": 24, "width": 24}),  # straight to a square
            "vit": ViTImageProcessorPil(size={"height": 16, "width": 16})}  # a composed adapter's vision processor


def _pixels(sides: list[Side], processor) -> torch.Tensor:
    return make_batch(sides, None, processor, max_length=None, text_keys=())[PIXEL_VALUES]


def _reference(paths: list[str], processor) -> torch.Tensor:
    """What every batch got before the cache: the transformers processor on decoded images."""
    return processor(images=[load_image(p) for p in paths], return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize("name", ["clip", "siglip", "vit"])
def test_cached_batches_get_the_image_processors_pixel_values_bit_for_bit(tmp_path, name):
    processor = _processors()[name]
    paths = _images(tmp_path / "images")
    cache = ic.open_image_cache(paths, processor, tmp_path / "cache")
    assert cache is not None and len(cache) == len(paths)
    order = [3, 0, 5, 1, 4, 2, 3]  # a batch in any order, with a repeat
    cached = _pixels([Side(image=cache.pixels(paths[i])) for i in order], processor)
    reference = _reference([paths[i] for i in order], processor)
    assert cached.dtype == reference.dtype == torch.float32
    assert torch.equal(cached, reference)
    # a batch mixing cached pixels and images the cache does not hold keeps batch order
    mixed = _pixels([Side(image=cache.pixels(paths[0])), Side(image=load_image(paths[1])),
                     Side(image=cache.pixels(paths[2]))], processor)
    assert torch.equal(mixed, _reference(paths[:3], processor))
    # DataLoader workers get the cache pickled: its file name, not its pixels, and they map the file again
    import pickle

    sent = pickle.dumps(cache)
    assert len(sent) < 4096
    assert torch.equal(_pixels([Side(image=pickle.loads(sent).pixels(p)) for p in paths], processor),
                       _reference(paths, processor))


def test_a_processor_without_a_fixed_output_size_gets_no_cache(tmp_path):
    from transformers import CLIPImageProcessorPil

    no_crop = CLIPImageProcessorPil(size={"shortest_edge": 32}, do_center_crop=False)  # output follows the image
    assert ic.open_image_cache(_images(tmp_path / "images"), no_crop, tmp_path / "cache") is None


def _builds(monkeypatch) -> list[int]:
    built: list[int] = []
    build = ic._build

    def counting(file, paths, processor, shape, *load):
        built.append(len(paths))
        return build(file, paths, processor, shape, *load)

    monkeypatch.setattr(ic, "_build", counting)
    return built


def test_a_changed_image_file_or_processor_setting_rebuilds_the_cache(tmp_path, monkeypatch):
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    from vembed.models.hf import clip_image_processor

    built = _builds(monkeypatch)
    paths, folder = _images(tmp_path / "images"), tmp_path / "cache"
    processor = clip_image_processor(32)
    first = ic.open_image_cache(paths, processor, folder)
    again = ic.open_image_cache(paths, clip_image_processor(32), folder)
    assert len(built) == 1 and again.file == first.file  # the same files and settings: mapped, not rebuilt

    changes = {
        "size": clip_image_processor(24),
        "resample": CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                          resample=Image.Resampling.BILINEAR),
        "crop": CLIPImageProcessorPil(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}),
    }
    files = {first.file}
    for what, changed in changes.items():
        cache = ic.open_image_cache(paths, changed, folder)
        assert cache.file not in files, f"a changed {what} did not rebuild the cache"
        files.add(cache.file)
        assert torch.equal(_pixels([Side(image=cache.pixels(p)) for p in paths], changed), _reference(paths, changed))
    assert len(built) == 1 + len(changes)

    # mean and std are applied per batch from the live processor: no rebuild, and still the processor's values
    other_mean = clip_image_processor(32)
    other_mean.image_mean, other_mean.image_std = [0.5, 0.5, 0.5], [0.25, 0.5, 0.125]
    same = ic.open_image_cache(paths, other_mean, folder)
    assert same.file == first.file and len(built) == 1 + len(changes)
    assert torch.equal(_pixels([Side(image=same.pixels(p)) for p in paths], other_mean), _reference(paths, other_mean))

    Image.new("RGB", (45, 45), (200, 10, 10)).save(paths[2])  # an image replaced in place
    renewed = ic.open_image_cache(paths, processor, folder)
    assert renewed.file not in files and len(built) == 2 + len(changes)
    assert torch.equal(_pixels([Side(image=renewed.pixels(paths[2]))], processor), _reference(paths[2:3], processor))


def test_an_image_rewritten_with_the_same_byte_size_rebuilds_the_cache(tmp_path, monkeypatch):
    """Only the modification time tells this change apart: an uncompressed BMP of the same dimensions has the same
    number of bytes whatever its pixels."""
    import os

    from PIL import Image

    from vembed.models.hf import clip_image_processor

    built = _builds(monkeypatch)
    folder, processor = tmp_path / "cache", clip_image_processor(32)
    paths = [str(tmp_path / f"{i}.bmp") for i in range(2)]
    for path, colour in zip(paths, [(10, 200, 10), (10, 10, 200)]):
        Image.new("RGB", (40, 40), colour).save(path)
    first = ic.open_image_cache(paths, processor, folder)
    size, stat = os.path.getsize(paths[0]), os.stat(paths[0])
    Image.new("RGB", (40, 40), (250, 250, 0)).save(paths[0])  # other pixels, the same size
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))  # a clock that ticks coarsely: later
    assert os.path.getsize(paths[0]) == size
    renewed = ic.open_image_cache(paths, processor, folder)
    assert len(built) == 2 and renewed.file != first.file, "a rewritten image kept its stale cached pixels"
    assert torch.equal(_pixels([Side(image=renewed.pixels(p)) for p in paths], processor), _reference(paths, processor))


_KILLED_BUILD = """
import os, sys
import vembed.data.images as images
from vembed.data import image_cache
from vembed.models.hf import clip_image_processor
decode, seen = images.load_image, []
def dying(path):
    seen.append(path)
    if len(seen) == 4:
        os._exit(3)  # killed half way through the build: no clean-up runs
    return decode(path)
images.load_image = dying
image_cache.open_image_cache(sys.argv[2:], clip_image_processor(32), sys.argv[1])
"""


def test_an_interrupted_build_is_never_read(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    import vembed.data.images as images

    paths, folder = _images(tmp_path / "images"), tmp_path / "cache"
    processor = _processors()["clip"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(folder), *paths], env=env, timeout=120)
    assert killed.returncode == 3
    built = _builds(monkeypatch)
    cache = ic.open_image_cache(paths, processor, folder)
    assert built == [len(paths)], "the killed build's file was trusted"
    assert torch.equal(_pixels([Side(image=cache.pixels(p)) for p in paths], processor), _reference(paths, processor))
    assert not list(folder.glob("*.tmp-*")), "the killed build's temporary file was left behind"

    decode, seen = images.load_image, []

    def stopping(path):
        seen.append(path)
        if len(seen) == 4:
            raise KeyboardInterrupt  # stopped half way through the build
        return decode(path)

    cache.file.unlink()  # the index written, the pixels never renamed into place
    monkeypatch.setattr(images, "load_image", stopping)
    with pytest.raises(KeyboardInterrupt):
        ic.open_image_cache(paths, processor, folder)
    assert not list(folder.glob("*.npy")) and not list(folder.glob("*.tmp-*")), "a partial cache was left"
    monkeypatch.setattr(images, "load_image", decode)
    cache = ic.open_image_cache(paths, processor, folder)
    assert len(built) == 3
    # a cache file cut short at its final name (a full disk, a copy cut off) is rebuilt
    cache.file.write_bytes(cache.file.read_bytes()[: cache.file.stat().st_size // 2])
    cache = ic.open_image_cache(paths, processor, folder)
    assert len(built) == 4
    assert torch.equal(_pixels([Side(image=cache.pixels(p)) for p in paths], processor), _reference(paths, processor))


def test_a_rebuild_killed_half_way_leaves_nothing_the_next_launch_trusts(tmp_path, monkeypatch):
    """A complete cache whose pixel file was later cut short keeps its index; the rebuild that follows is killed half
    way. Pixels written straight to the final name would then sit there at full size, their last rows zeros, beside
    that index: the next launch must rebuild, not read them."""
    import os

    import vembed.data.images as ic_images

    paths, folder = _images(tmp_path / "images"), tmp_path / "cache"
    processor = _processors()["clip"]
    built = _builds(monkeypatch)
    cache = ic.open_image_cache(paths, processor, folder)
    cache.file.write_bytes(cache.file.read_bytes()[:200])  # cut short; its index stays
    assert ic._index_file(cache.file).is_file()
    pid = os.fork()  # a child killed half way through the rebuild: no clean-up of any kind runs
    if pid == 0:
        try:
            decode, seen = ic_images.load_image, []

            def dying(path):
                seen.append(path)
                if len(seen) == 4:
                    os._exit(3)
                return decode(path)

            ic_images.load_image = dying
            ic.open_image_cache(paths, processor, folder)
        finally:
            os._exit(4)  # only reached if the build did not die
    for _ in range(600):  # bounded wait: at most a minute
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the rebuilding child did not die")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3
    assert len(built) == 1  # the child's build was not counted here
    again = ic.open_image_cache(paths, processor, folder)
    assert len(built) == 2, "the killed rebuild's pixels were trusted"
    pixels = np.load(again.file, mmap_mode="r")
    assert all(pixels[row].any() for row in range(len(paths))), "a row of the cache is all zeros"
    assert torch.equal(_pixels([Side(image=again.pixels(p)) for p in paths], processor), _reference(paths, processor))


def _example(i: int, image: str) -> Example:
    return Example(Side(text=f"q{i}"), Side(image=image), [], row=i + 1, source="pairs.jsonl")


def test_undecodable_images_are_replaced_and_counted_as_without_the_cache(tmp_path):
    paths = _images(tmp_path / "images")
    for bad in (paths[1], paths[2]):
        Path(bad).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)  # a PNG signature, then garbage
    processor = _processors()["clip"]
    examples = [_example(i, p) for i, p in enumerate(paths)]
    plain = PairDataset(examples, num_negatives=0)
    cached = PairDataset(examples, num_negatives=0, image_cache=ic.open_image_cache(paths, processor, tmp_path / "c"))
    for dataset in (plain, cached):
        items = [dataset[i] for i in [0, 1, 2, 3, 5, 1]]
        assert [item.query.text for item in items] == ["q0", "q3", "q3", "q3", "q5", "q3"]
    assert cached.decode_failures == plain.decode_failures == 2
    assert cached.decode_counts() == plain.decode_counts()
    assert isinstance(cached[0].positive.image, ic.CachedPixels)
    assert cached.decode_error(1) == plain.decode_error(1) is not None
    assert cached.decode_error(0) is plain.decode_error(0) is None
    sides = [Side(image=cached[i].positive.image) for i in range(len(paths))]
    reference = _reference([plain[i].positive.image for i in range(len(paths))], processor)
    assert torch.equal(_pixels(sides, processor), reference)


def _rank_opens_the_cache(paths: list[str], folder: str, out: str) -> None:
    import torch.distributed as dist

    from vembed.models.hf import clip_image_processor

    rank = dist.get_rank()
    build = ic._build

    def marking(file, paths, processor, shape, *load):
        Path(out, f"built-by-{rank}").touch()
        time.sleep(1)  # a slow build: without the lock the other rank would find no cache and build it too
        return build(file, paths, processor, shape, *load)

    ic._build = marking
    processor = clip_image_processor(32)
    cache = ic.open_image_cache(paths, processor, folder)
    torch.save({"file": str(cache.file), "pixels": _pixels([Side(image=cache.pixels(p)) for p in paths], processor)},
               Path(out, f"rank{rank}.pt"))


def test_two_ranks_build_the_cache_once_and_read_the_same_pixels(tmp_path):
    from vembed.models.hf import clip_image_processor

    paths = _images(tmp_path / "images")
    run_on_ranks(_rank_opens_the_cache, paths, str(tmp_path / "cache"), str(tmp_path), world=2, timeout=120)
    assert len(list(tmp_path.glob("built-by-*"))) == 1
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    assert results[0]["file"] == results[1]["file"]
    reference = _reference(paths, clip_image_processor(32))
    assert all(torch.equal(result["pixels"], reference) for result in results)


def test_the_recipe_key_turns_the_cache_on_for_training_and_batches_stay_the_same(tiny_clip_recipe, tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    def first_batch(image_cache: bool):
        data = dict(tiny_clip_recipe["data"], image_cache=image_cache, image_cache_dir=str(tmp_path / "cache"))
        trainer = Trainer(recipe_from_dict(dict(tiny_clip_recipe, data=data)))
        trainer.build()
        lines = dict(trainer.task.batch_lines(1))  # the start block
        return trainer.dataset, trainer.loader.collate_fn([trainer.dataset[i] for i in range(8)]), lines

    cached, with_cache, lines = first_batch(True)
    plain, without, plain_lines = first_batch(False)
    assert cached.image_cache is not None and plain.image_cache is None
    assert "built in" in lines["image cache"] and "image cache" not in plain_lines
    assert list((tmp_path / "cache").glob("images-*.npy"))
    for side in ("query", "positive"):
        assert with_cache[side].keys() == without[side].keys()
        for key, value in without[side].items():
            assert torch.equal(with_cache[side][key], value), f"{side} {key} differ"
    assert PIXEL_VALUES in with_cache["positive"]


def test_an_unknown_image_cache_key_is_still_a_recipe_error(tiny_clip_recipe):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match="image_cach"):
        recipe_from_dict(dict(tiny_clip_recipe, data=dict(tiny_clip_recipe["data"], image_cach=True)))
