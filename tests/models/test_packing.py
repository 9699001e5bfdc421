"""Packed batches (`packing: true`, vembed/models/packing.py): each side's texts run as one row of real tokens with
position ids restarting per text and attention kept within each text. On a CPU the attention is each text alone
(exact); these tests hold the packed path to the padded one (fp32, 1e-5) for every text family that packs, for
embeddings, token vectors and SPLADE vectors, for a training step under GradCache and on 2 ranks, and with dropout on
against a padded forward that draws one dropout mask per real token (what packing promises)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from one_step import one_step, two_rank_gradients
from one_step import relative_difference as _relative

from vembed.components import recipe_from_dict
from vembed.models.packing import Packing, first_position, packed_attention, packed_forward, use_packed_attention

BATCH = 8
TOLERANCE = 1e-5
TINY = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 37, "max_position_embeddings": 64}
# Every family a text adapter (or a cross-encoder) may be given whose attention goes through transformers' attention
# interface; the extra keys make each tiny and exercise its particular path (RoBERTa's positions after the padding
# index, ModernBERT's sliding-window layers, Qwen's grouped-query causal attention).
FAMILIES = {
    "bert": {}, "roberta": {"pad_token_id": 1}, "xlm-roberta": {"pad_token_id": 1}, "electra": {"embedding_size": 32},
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 37},
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 4, "pad_token_id": 0, "bos_token_id": 2,
                   "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3},
    "qwen2": {"num_key_value_heads": 2}, "qwen3": {"num_key_value_heads": 2, "head_dim": 8}, "gte": {},
}
DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                "embedding_dropout", "mlp_dropout", "seq_classif_dropout", "qa_dropout")


def _lengths_mask(lengths: list[int]) -> torch.Tensor:
    return (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()


def _tiny_model(family: str, **overrides):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(family, **{**TINY, **FAMILIES[family], **overrides})
    for key in DROPOUT_KEYS:
        if hasattr(config, key) and key not in overrides:
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return AutoModel.from_config(config, attn_implementation="sdpa").eval()


def test_packing_lays_out_the_real_tokens_and_restarts_positions():
    mask = _lengths_mask([3, 1, 4])
    packing = Packing.of(mask)
    assert packing.cu_seq_lens.tolist() == [0, 3, 4, 8] and packing.max_length == 4
    assert packing.position_ids().tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packing.position_ids(offset=2).tolist() == [[2, 3, 4, 2, 2, 3, 4, 5]]
    values = torch.arange(12).view(3, 4) * 10
    packed = packing.pack(values)
    assert packed.tolist() == [[0, 10, 20, 40, 80, 90, 100, 110]]
    assert packing.unpack(packed.unsqueeze(-1)).squeeze(-1).tolist() == [[0, 10, 20, 0], [40, 0, 0, 0],
                                                                        [80, 90, 100, 110]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_packed_forward_equals_the_padded_forward(family):
    model = _tiny_model(family)
    lengths = [12, 3, 7, 1, 9]
    mask = _lengths_mask(lengths)
    torch.manual_seed(1)
    pad = model.config.pad_token_id or 0
    ids = torch.randint(5, 90, mask.shape) * mask + (1 - mask) * pad
    tokens = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        padded = model(**tokens).last_hidden_state
        use_packed_attention(model)
        accepted = {"token_type_ids"} if "token_type_ids" in model.forward.__code__.co_varnames else set()
        packed = packed_forward(model, tokens, lambda output: output.last_hidden_state, accepted,
                                first_position(model))
    keep = mask.bool()
    assert packed.shape == padded.shape
    assert torch.allclose(packed[keep], padded[keep], atol=TOLERANCE, rtol=0), \
        f"max difference {(packed[keep] - padded[keep]).abs().max():.2e}"
    assert (packed[~keep] == 0).all()  # padding positions hold no value


def test_the_first_position_follows_the_position_table():
    assert first_position(_tiny_model("bert")) == 0
    assert first_position(_tiny_model("roberta")) == 2  # RoBERTa counts positions after its padding index (1)


def test_a_padded_call_of_a_packing_model_is_refused():
    """transformers makes no padding mask for a custom attention, so a padded call would attend to padding: the
    attention refuses it rather than compute it wrong."""
    model = _tiny_model("bert")
    use_packed_attention(model)
    with pytest.raises(ValueError, match="runs packed batches only"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=_lengths_mask([5, 3]))


def test_each_text_attends_only_within_itself_and_its_window():
    """Two texts packed: the second text's outputs do not change when the first text's values do; a sliding window
    of w lets a token see w - 1 positions each way (transformers' flash reading of ModernBERT's window)."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, 7, 4) for _ in range(3))
    bounds = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, _ = packed_attention(torch.nn.Module(), query, key, value, None, cu_seq_lens_q=bounds, max_length_q=4)
    changed = value.clone()
    changed[:, :, :3] += 1.0
    again, _ = packed_attention(torch.nn.Module(), query, key, changed, None, cu_seq_lens_q=bounds, max_length_q=4)
    assert torch.equal(out[:, 3:], again[:, 3:]) and not torch.allclose(out[:, :3], again[:, :3])
    windowed, _ = packed_attention(torch.nn.Module(), query, key, value, None, cu_seq_lens_q=bounds, max_length_q=4,
                                   sliding_window=2)
    second = (slice(None), slice(None), slice(3, 7))
    distance = torch.arange(4)[:, None] - torch.arange(4)[None, :]
    reference = torch.nn.functional.scaled_dot_product_attention(
        query[second], key[second], value[second], attn_mask=distance.abs() <= 1)
    assert torch.allclose(windowed[:, 3:], reference.transpose(1, 2), atol=1e-6)


# --- through the adapter and the training step ------------------------------------------------------------------
@pytest.fixture
def uneven_texts(tmp_path, tiny_tokenizer_dir) -> dict:
    """Text pairs from 1 to ~23 tokens with a hard negative each; a tiny BERT without dropout."""
    words = "red green blue square circle shape small large bright dark".split()
    rows = [{"query": " ".join(words[(i + j) % 10] for j in range(1 + (i * 7) % 23)),
             "positive": " ".join(words[(i * 3 + j) % 10] for j in range(1 + (i * 5) % 17)),
             "negatives": [" ".join(words[j % 10] for j in range(1 + i % 4))]} for i in range(16)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "model_type": "text", "pooling": "mean", "tokenizer_name": tiny_tokenizer_dir,
        "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "data": {"train": str(path)}, "output_dir": str(tmp_path / "run"), "batch_size": BATCH, "seed": 0,
        "eval_before_training": False, "learnable_temperature": True,
    }


def _step(raw: dict, rows: list[int]) -> tuple[dict[str, torch.Tensor], float, torch.Tensor]:
    return one_step(raw, rows, seed=7)  # the dropout test's reference draws from the same seed


def _trainer(raw: dict):
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    return trainer


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


# cls and last pool one token, whose gradients in a random tiny BERT are mostly cancellation (parameter gradients of
# norm 1e-5): fp32 rounding alone moves them 1e-3 relative, padded or packed. They are compared in float64, where the
# packed and padded steps agree to 1e-10 (and differ by 1e-3 with the position ids not restarting).
@pytest.mark.parametrize("variant, tolerance", [
    ({"pooling": "mean"}, TOLERANCE), ({"pooling": "cls"}, 1e-10), ({"pooling": "last"}, 1e-10),
    ({"embedding": "multi_vector", "multi_vector_dim": 16, "query_length": 24, "loss_type": "late_interaction"},
     TOLERANCE),
    ({"embedding": "sparse", "loss_type": "infonce", "temperature": 1.0, "pooling": "mean"}, TOLERANCE),
], ids=["mean", "cls-float64", "last-float64", "colbert", "splade"])
def test_a_packed_training_step_equals_the_padded_step(uneven_texts, mask_tokenizer_dir, variant, tolerance,
                                                       request):
    if tolerance < TOLERANCE:
        request.getfixturevalue("float64")
    raw = dict(uneven_texts, **variant)
    if variant.get("embedding") == "multi_vector":
        raw["tokenizer_name"] = mask_tokenizer_dir
    if variant.get("embedding") == "sparse":
        raw.pop("pooling")
        raw.pop("learnable_temperature")
    rows = list(range(BATCH))
    padded, padded_loss, padded_query = _step(raw, rows)
    packed, packed_loss, packed_query = _step(dict(raw, packing=True), rows)
    assert torch.allclose(packed_query, padded_query, atol=tolerance), "embeddings differ"
    assert abs(packed_loss - padded_loss) <= tolerance * abs(padded_loss)
    assert _relative(packed, padded) <= tolerance


def test_a_packed_step_under_gradient_cache_equals_the_padded_step(uneven_texts):
    rows = list(range(BATCH))
    padded, padded_loss, _ = _step(uneven_texts, rows)
    cached, cached_loss, _ = _step(dict(uneven_texts, packing=True, use_gradient_cache=True,
                                        gradient_cache_chunk_size=3), rows)
    assert abs(cached_loss - padded_loss) <= TOLERANCE * abs(padded_loss)
    assert _relative(cached, padded) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("grad_cache", [{}, {"use_gradient_cache": True, "gradient_cache_chunk_size": 3}],
                         ids=["plain", "gradcache"])
def test_two_packed_ranks_equal_one_padded_process_on_the_whole_batch(uneven_texts, tmp_path, grad_cache):
    raw = dict(uneven_texts, batch_size=BATCH // 2, packing=True, **grad_cache)
    ddp = two_rank_gradients(raw, tmp_path, BATCH, seed=7)
    one, _, _ = _step(uneven_texts, list(range(BATCH)))
    assert _relative(ddp, one) <= TOLERANCE


# --- dropout on -----------------------------------------------------------------------------------------------------
class _PerTokenDropout(torch.nn.Module):
    """The padded reference's dropout: one mask draw per real token and feature, in row-major order of the real
    tokens (the packed order), scattered into the padded layout."""

    def __init__(self, p: float, keep: list[torch.Tensor]):
        super().__init__()
        self.p, self.keep = p, keep  # keep[0]: the (rows, positions) mask of the forward under way

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return hidden
        keep = self.keep[0]
        real = hidden[keep]
        drawn = torch.nn.functional.dropout(real, self.p, training=True)
        return hidden.masked_scatter(keep.unsqueeze(-1), drawn)


def test_with_dropout_on_packing_draws_one_mask_per_token(uneven_texts):
    """Hidden dropout on (attention dropout off: packing does not apply it): a packed step equals a padded step whose
    dropout draws one value per real token in packed order; padding changes no text's mask."""
    from accelerate.utils import send_to_device

    raw = dict(uneven_texts, model_config={**uneven_texts["model_config"], "hidden_dropout_prob": 0.2})
    rows = list(range(BATCH))
    packed, packed_loss, _ = _step(dict(raw, packing=True), rows)
    trainer = _trainer(raw)
    adapter = trainer.accelerator.unwrap_model(trainer.model).adapter
    current: list[torch.Tensor] = [torch.ones(1, 1, dtype=torch.bool)]
    for name, module in list(adapter.model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Dropout):
                setattr(module, child_name, _PerTokenDropout(child.p, current))
    inner = adapter.encode

    def encode(inputs):
        current[0] = inputs["attention_mask"].bool()
        return inner(inputs)

    adapter.encode = encode
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]), trainer.accelerator.device)
    torch.manual_seed(7)
    loss = trainer.train_step(batch).item()
    objective = trainer.accelerator.unwrap_model(trainer.model)
    reference = {n: p.grad.detach().clone() for n, p in objective.named_parameters() if p.grad is not None}
    assert abs(packed_loss - loss) <= TOLERANCE * abs(loss)
    assert _relative(packed, reference) <= TOLERANCE
    plain, plain_loss, _ = _step(raw, rows)  # the stock padded step draws other masks: a real difference
    assert _relative(packed, plain) > 1e-3


# --- refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, key", [
    ({"attn_implementation": "sdpa"}, "attn_implementation"),
    ({"length_chunks": 2}, "length_chunks"),
])
def test_packing_with_a_key_it_replaces_is_refused(uneven_texts, extra, key):
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    with pytest.raises(RecipeError) as refused:
        check_recipe(recipe_from_dict(dict(uneven_texts, packing=True, **extra)))
    assert refused.value.key == key


def test_a_model_kind_that_cannot_pack_is_refused(tiny_clip_recipe):
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    with pytest.raises(RecipeError, match="cannot pack") as refused:
        check_recipe(recipe_from_dict(dict(tiny_clip_recipe, packing=True)))
    assert refused.value.key == "packing"


def test_an_architecture_with_its_own_attention_is_refused_before_any_weight_is_read(uneven_texts):
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    raw = dict(uneven_texts, packing=True, model_config={**uneven_texts["model_config"], "model_type": "mpnet"})
    with pytest.raises(RecipeError, match="MPNetModel computes its attention itself") as refused:
        check_recipe(recipe_from_dict(raw))
    assert refused.value.key == "packing"


def test_building_an_architecture_with_its_own_attention_is_refused_too():
    from transformers import AutoConfig, AutoModel

    from vembed.errors import RecipeError

    model = AutoModel.from_config(AutoConfig.for_model("mpnet", **TINY))
    with pytest.raises(RecipeError, match="MPNetModel computes its attention itself") as refused:
        use_packed_attention(model)
    assert refused.value.key == "packing"


def test_a_saved_packed_model_loads_as_a_plain_transformers_model(uneven_texts, tmp_path):
    """The attention implementation is vembed's at run time only: config.json names none of it, so transformers and
    sentence-transformers load the folder as they load any."""
    from transformers import AutoModel

    trainer = _trainer(dict(uneven_texts, packing=True))
    adapter = trainer.accelerator.unwrap_model(trainer.model).adapter
    adapter.save(tmp_path / "saved")
    assert "vembed_packed" not in (tmp_path / "saved" / "config.json").read_text()
    AutoModel.from_pretrained(tmp_path / "saved")
    from vembed.models.base import load_adapter

    loaded = load_adapter(tmp_path / "saved")
    assert loaded.settings.packing  # encodes packed again, as it trained


@pytest.mark.parametrize("family", ["bert", "roberta", "electra", "distilbert"])
def test_a_cross_encoder_packed_below_its_head_scores_as_padded(family):
    """The layer stack runs packed and the head (BERT's pooler + classifier, RoBERTa's head at the first token) reads
    the unpacked states: the pair scores of the padded forward."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from vembed.models.packing import layer_stack, packed_below_head

    config = AutoConfig.for_model(family, **{**TINY, **FAMILIES[family]}, num_labels=1)
    for key in DROPOUT_KEYS:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").eval()
    mask = _lengths_mask([12, 3, 7, 1, 9])
    pad = config.pad_token_id or 0
    tokens = {"input_ids": torch.randint(5, 90, mask.shape) * mask + (1 - mask) * pad, "attention_mask": mask}
    with torch.no_grad():
        padded = model(**tokens).logits
        use_packed_attention(model)
        accepted = {"token_type_ids"} if "token_type_ids" in model.forward.__code__.co_varnames else set()
        stack = model.get_submodule(layer_stack(model))
        packed = packed_below_head(model, stack, tokens, accepted, first_position(model)).logits
    assert torch.allclose(packed, padded, atol=TOLERANCE), (packed - padded).abs().max()


@pytest.mark.slow
def test_a_packed_ddp_launch_trains_evaluates_and_saves_as_one_padded_process(uneven_texts, tmp_path):
    """Through the door users run (`accelerate launch` on 2 gloo ranks): a packed run's per-step losses, its evaluation
    before and after training and its saved weights are those of one padded process on the whole batch."""
    from launching import final_weights, launch, max_relative_difference, train_in_this_process, write_recipe

    rows = [json.loads(line) for line in Path(uneven_texts["data"]["train"]).read_text().splitlines()]
    validation = tmp_path / "validation.jsonl"  # no row whose positive is its negative: a tie flips with rounding
    validation.write_text("\n".join(json.dumps(row) for row in rows if row["positive"] not in row["negatives"]))
    base = dict(uneven_texts, data={"train": uneven_texts["data"]["train"], "validation": str(validation)})
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    train_in_this_process(write_recipe(base, padded, save_steps=None))
    launch("ddp_cpu.yaml", write_recipe(base, packed, save_steps=None, packing=True, batch_size=BATCH // 2))
    runs = {name: json.loads((out / "metrics.json").read_text()) for name, out in (("padded", padded),
                                                                                  ("packed", packed))}
    losses = {name: [record["loss"] for record in metrics["loss_history"]] for name, metrics in runs.items()}
    assert len(losses["packed"]) == 3 and losses["packed"] == pytest.approx(losses["padded"], rel=TOLERANCE)
    for split in ("before", "validation"):
        assert runs["packed"][split].keys() == runs["padded"][split].keys()
        for key, value in runs["padded"][split].items():
            assert runs["packed"][split][key] == pytest.approx(value, abs=1e-5), (split, key)
    assert max_relative_difference(final_weights(packed), final_weights(padded)) <= 1e-4
