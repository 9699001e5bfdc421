"""Lists with a teacher's scores (`{"query", "documents", "scores"}`) for the distillation losses: read as the lists'
targets, checked per row like labels, and trained on."""

from __future__ import annotations

import json

import pytest
import torch

from vembed.components import recipe_from_dict
from vembed.errors import DataError


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_scores_are_a_lists_targets(rerank_recipe, tmp_path):
    from vembed.reranking.data import read_lists

    lists = _write(tmp_path / "teacher.jsonl", [{"query": "q", "documents": ["a", "b", "c"], "scores": [7.5, 1, -2]},
                                                {"query": "r", "documents": ["d", "e"], "scores": [0.5, 3.25]}])
    found, report = read_lists(recipe_from_dict(dict(rerank_recipe, data={"train": str(lists)})).data, "train")
    assert [item.labels for item in found] == [[7.5, 1.0, -2.0], [0.5, 3.25]]
    assert (report.lists, report.pairs) == (2, 5)


@pytest.mark.parametrize("row, says", [
    ({"query": "r", "documents": ["a", "b", "c"], "scores": [1.0, 0.0]},
     "has 3 documents but 2 scores; give one score per document"),
    ({"query": "r", "documents": ["a", "b"], "scores": [1.0, 0.0], "labels": [1, 0]},
     "has both 'labels' and 'scores'; give one"),
    ({"query": "r", "documents": ["a", "b"], "scores": [1.0, "high"]}, "label 'high' is not a number"),
], ids=["count", "both", "not-a-number"])
def test_a_bad_scores_row_names_file_and_row(rerank_recipe, tmp_path, row, says):
    from vembed.reranking.data import read_lists

    bad = _write(tmp_path / "bad.jsonl", [{"query": "q", "documents": ["a", "b"], "scores": [1.0, 0.0]}, row])
    with pytest.raises(DataError) as error:
        read_lists(recipe_from_dict(dict(rerank_recipe, data={"train": str(bad)})).data, "train")
    assert str(error.value).startswith(f"data error: {bad}, row 2: {says}")


def test_vembed_train_refuses_mismatched_scores_in_one_line_and_writes_nothing(rerank_recipe, tmp_path, capsys):
    import yaml

    from vembed.cli import main

    bad = _write(tmp_path / "bad.jsonl", [{"query": "q", "documents": ["a", "b"], "scores": [1.0]}])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dict(rerank_recipe, loss_type="rerank_distill_kl", data={"train": str(bad)})))
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == f"data error: {bad}, row 1: has 2 documents but 1 scores; give one score per document"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("loss_type", ["rerank_margin_mse", "rerank_distill_kl"])
def test_a_reranker_distils_a_teachers_scores(rerank_recipe, tmp_path, loss_type):
    """The rerank task's objective on lists read from a scores file: a few optimizer steps cut the loss (the student
    moves towards the teacher)."""
    import torch

    from vembed.reranking.data import collate_lists, read_lists
    from vembed.reranking.task import RerankTask

    rows = [{"query": f"a photo of a {word}", "documents": [f"a {word} on white", "a blue page", "a star", "of a"],
             "scores": [4.0, 1.0, -1.0, -3.0]} for word in ("red square", "green circle")]
    teacher = _write(tmp_path / "teacher.jsonl", rows)
    recipe = recipe_from_dict(dict(rerank_recipe, loss_type=loss_type, data={"train": str(teacher)}))
    torch.manual_seed(0)
    objective = RerankTask(recipe).build_objective()
    batch = collate_lists(objective.adapter, read_lists(recipe.data, "train")[0])
    assert batch["labels"][0].tolist() == [4.0, 1.0, -1.0, -3.0]
    optimizer = torch.optim.Adam(objective.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = objective(batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.3 * losses[0], losses


def test_collating_lists_does_a_fixed_number_of_torch_calls_whatever_the_batch():
    """collate_lists runs in the training process every step (data.num_workers 0): its labels and mask are built in
    Python and made tensors once, not written list by list (~6 torch calls a list; bench/rerank_vs_st.py --tiny). The
    values are unchanged: shorter lists padded with label 0 and mask False."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vembed.reranking.data import RankList, collate_lists

    class Adapter:
        def preprocess(self, queries, documents):
            return list(zip(queries, documents))

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def lists(count):
        return [RankList(f"q{i}", [f"d{j}" for j in range(2 + i % 3)], [1.0, *[0.5] * (1 + i % 3)])
                for i in range(count)]

    calls = []
    for count in (2, 16):
        Count.calls = 0
        with Count():
            batch = collate_lists(Adapter(), lists(count))
        calls.append(Count.calls)
    assert calls[0] == calls[1] <= 4, calls
    assert batch["labels"][:3].tolist() == [[1.0, 0.5, 0.0, 0.0], [1.0, 0.5, 0.5, 0.0], [1.0, 0.5, 0.5, 0.5]]
    assert batch["mask"][:2].tolist() == [[True, True, False, False], [True, True, True, False]]
    assert batch["labels"].dtype == torch.float32 and batch["mask"].dtype == torch.bool
    assert batch["pairs"][:3] == [("q0", "d0"), ("q0", "d1"), ("q1", "d0")]
