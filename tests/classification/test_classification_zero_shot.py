"""Classification from a whole CLIP with `head_init: class_names`: the task's step-0 model scores images as CLIP's
zero-shot does (logits to 1e-6, class names from the training folders); through the train entrypoint the run's
step-0 report is CLIP's zero-shot report, training moves the head and final/ reloads with it; a backbone without a
text tower is refused with one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.classification.test_classification import CLASSES, digits, recipe, saved_model_metrics, train  # noqa: F401

TEMPLATE = "a handwritten {}"


@pytest.fixture(scope="module")
def clip_folder(dummy_data_dir, tmp_path_factory):
    """A tiny random-init CLIP saved as a contrastive run saves final/."""
    from tests.tiny_models import TINY_CLIP_CONFIG
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    path = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    clip = MODELS.get("clip").from_recipe(recipe_from_dict(
        {"model_type": "clip", "model_config": TINY_CLIP_CONFIG, "tokenizer_name": str(dummy_data_dir / "tokenizer")}))
    clip.save(path)
    return path


def validation_batch(folder: Path, digits: Path):
    """The validation split as the classification task reads it: (labelled images, preprocessed batch)."""
    from vembed.classification.labelled import read_labelled_images
    from vembed.classification.task import ClassificationCollator, LabelledImageDataset
    from vembed.models import load_adapter

    data = read_labelled_images(str(digits / "validation" / "labels.csv"), "data.validation", names=sorted(CLASSES))
    return data, ClassificationCollator(load_adapter(folder))([LabelledImageDataset(data)[i] for i in range(len(data))])


def clip_zero_shot_logits(folder: Path, pixels: torch.Tensor) -> torch.Tensor:
    """CLIP's own zero-shot scores of images against one prompt per class (logits_per_image), classes sorted."""
    from transformers import AutoTokenizer, CLIPModel

    model, tokenizer = CLIPModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    tokens = tokenizer([TEMPLATE.format(name) for name in sorted(CLASSES)], padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                     pixel_values=pixels).logits_per_image


def test_the_tasks_step_zero_model_scores_as_clip_zero_shot(digits, clip_folder, tmp_path):  # noqa: F811
    from vembed.components import recipe_from_dict
    from vembed.recipe_checks import check_recipe
    from vembed.tasks import task_for

    config = recipe_from_dict(recipe(digits, tmp_path / "run", model_config=None, model_name=str(clip_folder),
                                     head_init="class_names", class_name_template=TEMPLATE))
    check_recipe(config)
    task = task_for(config)(config)
    task.load_train_data()  # the class names come from the training folders
    objective = task.build_objective().eval()
    _, batch = validation_batch(clip_folder, digits)
    pixels = batch["inputs"]["pixel_values"]
    with torch.no_grad():
        logits = objective(classify=batch["inputs"])
    torch.testing.assert_close(logits, clip_zero_shot_logits(clip_folder, pixels), atol=1e-6, rtol=0)


def test_step_zero_is_clips_zero_shot_and_the_trained_head_reloads(digits, clip_folder, tmp_path):  # noqa: F811
    from transformers import AutoModel

    from vembed.classification.evaluation import classification_metrics
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS, load_adapter

    raw = recipe(digits, tmp_path / "run", model_config=None, model_name=str(clip_folder), head_init="class_names",
                 class_name_template=TEMPLATE, eval_before_training=True, max_steps=4)
    assert train(raw, tmp_path / "recipe.yaml") == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    data, batch = validation_batch(clip_folder, digits)
    zero_shot = classification_metrics(clip_zero_shot_logits(clip_folder, batch["inputs"]["pixel_values"]).numpy(),
                                       np.array(data.labels), sorted(CLASSES))
    assert metrics["before"]["confusion_matrix"] == zero_shot["confusion_matrix"]
    assert metrics["before"]["accuracy"] == pytest.approx(zero_shot["accuracy"], abs=1e-9)

    final = tmp_path / "run" / "final"
    model = load_adapter(final).eval()
    assert (model.settings.head_init, model.settings.label_names) == ("class_names", sorted(CLASSES))
    again = saved_model_metrics(tmp_path / "run", digits)
    assert again["confusion_matrix"] == metrics["validation"]["confusion_matrix"]
    # Trained from the text rows: the head moved (the recipe builds it as step 0 had it).
    initial = MODELS.get("vision").from_recipe(recipe_from_dict(
        {**raw, "num_labels": len(CLASSES), "label_names": sorted(CLASSES)})).classifier.weight
    assert not torch.allclose(model.classifier.weight, initial, atol=1e-4)
    assert AutoModel.from_pretrained(final).config.model_type == "clip_vision_model"


def test_class_names_over_a_backbone_without_a_text_tower_stop_with_one_line(digits, tmp_path, capsys):  # noqa: F811
    raw = recipe(digits, tmp_path / "run", head_init="class_names")
    assert train(raw, tmp_path / "recipe.yaml") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert ("head_init: class_names embeds the class names with a CLIP/SigLIP text tower, but model_config builds a "
            "'vit' model, which has none; point model_config at a whole clip or siglip model, or use head_init: "
            "random") in err
    assert not (tmp_path / "run").exists()
