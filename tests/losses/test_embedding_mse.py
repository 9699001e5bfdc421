"""Embedding distillation (loss_type embedding_mse): the loss equals sentence-transformers' MSELoss, and the teacher's
extracted vectors reach each row by its file and row, refused when missing, stale or of another size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from text_teachers import HIDDEN, distill_recipe, extract_teacher, save_text_teacher, write_translations
from torch import nn

from vembed.components import recipe_from_dict
from vembed.errors import DataError, RecipeError
from vembed.losses.distillation import EmbeddingMSELoss

B, D = 6, 10


class ColumnModel(nn.Module):
    """Stands in for a SentenceTransformer: column i's embedding is the i-th fixed tensor."""

    def __init__(self, columns: list[torch.Tensor]):
        super().__init__()
        self.columns = columns

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": self.columns[int(features["column"])]}


def _leaves(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, p, t = (torch.randn(B, D, generator=generator, dtype=torch.float64) for _ in range(3))
    return q.requires_grad_(), p.requires_grad_(), t


def test_embedding_mse_equals_sentence_transformers_mse_loss_on_source_and_translation():
    st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    q, p, teacher = _leaves(0)
    ours = EmbeddingMSELoss()(q, p, teacher=teacher)
    our_grads = torch.autograd.grad(ours, [q, p])
    theirs = st_losses.MSELoss(ColumnModel([q, p]))([{"column": 0}, {"column": 1}], teacher)
    their_grads = torch.autograd.grad(theirs, [q, p])
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, theirs.item())
    for mine, other in zip(our_grads, their_grads):
        assert (mine - other).abs().max().item() <= 1e-6


def test_one_text_column_mapped_to_both_sides_is_the_mse_of_that_column_alone():
    # Model-to-model distillation on single sentences: data.columns.positive names the query's column.
    st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    q, _, teacher = _leaves(1)
    ours = EmbeddingMSELoss()(q, q, teacher=teacher)
    (our_grad,) = torch.autograd.grad(ours, [q])
    theirs = st_losses.MSELoss(ColumnModel([q]))([{"column": 0}], teacher)
    (their_grad,) = torch.autograd.grad(theirs, [q])
    assert abs(ours.item() - theirs.item()) <= 1e-6
    assert (our_grad - their_grad).abs().max().item() <= 1e-6


def test_the_loss_refuses_a_batch_without_teacher_vectors_or_of_another_size():
    q, p, teacher = _leaves(2)
    with pytest.raises(ValueError, match="teacher="):
        EmbeddingMSELoss()(q, p)
    with pytest.raises(ValueError, match="shape"):
        EmbeddingMSELoss()(q, p, teacher=teacher[:, :4])


def test_a_recipe_names_the_loss_and_its_teacher_folder():
    from vembed.losses import build_loss

    loss = build_loss(recipe_from_dict({"model_type": "text", "model_name": "x", "loss_type": "embedding_mse",
                                        "teacher_embeddings": "teacher/"}))
    assert type(loss) is EmbeddingMSELoss and loss.config["teacher_embeddings"] == "teacher/"
    with pytest.raises(RecipeError, match="teacher_embeddings"):  # required: nothing to distil from otherwise
        recipe_from_dict({"model_type": "text", "model_name": "x", "loss_type": "embedding_mse"})


# --- the extracted teacher file, matched to the rows -----------------------------------------------------------------

@pytest.fixture(scope="module")
def distill(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("distill")
    teacher = save_text_teacher(root / "teacher", tiny_tokenizer_dir)
    train = write_translations(root / "train.jsonl")
    recipe = distill_recipe(tiny_tokenizer_dir, train, root / "teacher_embeddings", root / "run")
    extract_teacher(teacher, recipe, root / "recipe.yaml")
    return {"root": root, "teacher": teacher, "train": train, "recipe": recipe}


def _rows(recipe: dict, train: Path):
    from vembed.data.sources import load_rows

    raw = dict(recipe, data={**recipe["data"], "train": str(train)})
    return load_rows(recipe_from_dict(raw).data, "train", num_hard_negatives=0)[0]


def test_each_row_gets_the_teacher_embedding_of_its_own_query_text(distill, tmp_path):
    from vembed.data.records import Side
    from vembed.data.teacher_embeddings import TeacherEmbeddings
    from vembed.models.foreign import load_embedding_model

    teacher = TeacherEmbeddings(distill["recipe"]["teacher_embeddings"])
    rows = _rows(distill["recipe"], distill["train"])
    teacher.check_rows(rows)
    picked = [rows[i] for i in (11, 2, 7)]  # out of order, across shards of 5
    model = load_embedding_model(distill["teacher"]).eval()
    with torch.no_grad():
        expected = model.encode(model.preprocess([Side(text=example.query.text) for example in picked]))
    assert torch.allclose(teacher.lookup(picked), expected, atol=1e-6)
    assert teacher.dim == HIDDEN and len(teacher.embedding) == 16


def test_rows_the_teacher_file_lacks_are_refused_naming_the_first(distill, tmp_path):
    from vembed.data.teacher_embeddings import TeacherEmbeddings

    train = tmp_path / "train.jsonl"
    train.write_text(distill["train"].read_text() + json.dumps({"en": "one more", "de": "noch eins"}) + "\n")
    # another path: no vector of this file at all; the same path with a row more: that row is missing
    with pytest.raises(DataError, match="no teacher embedding for 17 of the 17"):
        TeacherEmbeddings(distill["recipe"]["teacher_embeddings"]).check_rows(_rows(distill["recipe"], train))
    original = distill["train"].read_text()
    try:
        distill["train"].write_text(train.read_text())
        with pytest.raises(DataError, match=r"row 17: .*no teacher embedding for 1 of the 17"):
            TeacherEmbeddings(distill["recipe"]["teacher_embeddings"]).check_rows(
                _rows(distill["recipe"], distill["train"]))
    finally:
        distill["train"].write_text(original)


def test_a_changed_query_text_makes_the_teacher_file_stale(distill):
    from vembed.data.teacher_embeddings import TeacherEmbeddings

    original = distill["train"].read_text()
    lines = original.splitlines()
    lines[4] = json.dumps({"en": "question 4 rewritten", "de": "frage 4 zur form 4"})
    lines[9] = json.dumps({"en": "question 9 about shape 4", "de": "a new translation only"})  # not the teacher's text
    try:
        distill["train"].write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError, match=r"row 5: the query text of 1 training rows changed.*stale"):
            TeacherEmbeddings(distill["recipe"]["teacher_embeddings"]).check_rows(
                _rows(distill["recipe"], distill["train"]))
    finally:
        distill["train"].write_text(original)


def test_a_student_of_another_size_than_the_teacher_is_refused_before_anything_is_built(distill):
    from vembed.recipe_checks import check_recipe

    raw = dict(distill["recipe"])
    check_recipe(recipe_from_dict(raw))
    raw["model_config"] = {**raw["model_config"], "hidden_size": 16}
    with pytest.raises(RecipeError, match=r"teacher_embeddings: .* have 32 dims, this student's 16"):
        check_recipe(recipe_from_dict(raw))
    with pytest.raises(RecipeError, match="mrl_dims"):
        check_recipe(recipe_from_dict(dict(distill["recipe"], mrl_dims=[32, 16])))
    with pytest.raises(RecipeError, match="holds no teacher embeddings"):
        check_recipe(recipe_from_dict(dict(distill["recipe"], teacher_embeddings=str(distill["root"]))))


def test_training_steps_read_the_teacher_vectors_from_the_batch(distill, tmp_path):
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(dict(distill["recipe"], output_dir=str(tmp_path / "run"))))
    trainer.build()
    batch = trainer.loader.collate_fn([trainer.dataset[i] for i in range(4)])
    assert batch["teacher"].shape == (4, HIDDEN)
    loss = trainer.train_step(batch)
    assert torch.isfinite(loss) and loss.item() > 0
