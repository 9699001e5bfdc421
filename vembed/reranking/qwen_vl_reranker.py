"""A Qwen-VL reranker (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; Qwen3-VL-Reranker 2B/8B are Qwen3-VL): the query and the
document are read jointly in the released Qwen3-VL-Reranker's chat template, which asks for a "yes"/"no" answer::

    <|im_start|>system\\n{JUDGE}<|im_end|>\\n<|im_start|>user\\n<Instruct>: {instruction}<Query>:{images}{text}
    <Document>:{images}{text}<|im_end|>\\n<|im_start|>assistant\\n

(one sequence; the line break before `<Document>:` is part of it; a part with neither text nor image says "NULL").
The pair's score is the logit of "yes" against "no" at the last token, h · (W_yes - W_no) with W the LM head's rows,
as the released code scores (sigmoid of it: the probability of "yes"). Reading the LM head's own rows, not a new
head, is what lets a released reranker fine-tune from where it is, and what keeps the saved folder a plain
ForConditionalGeneration checkpoint that transformers loads and scores as the released one.

Everything else (tokenizer and vision-token checks, images, padding, LoRA, pixel budgets, save/load) is the Qwen-VL
family's (`QwenVLModel`, vembed/models/qwen_vl.py, which the embedder shares), extended here with the pair template
and the score.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field

from vembed.errors import RecipeError
from vembed.models.base import ADAPTER_FILE
from vembed.models.qwen_vl import (
    ENDINGS,
    PLANNED_TEXT_TOKENS,
    SYSTEM_START,
    USER_START,
    QwenVLModel,
    QwenVLModelSettings,
    image_placeholders,
    side_text,
)
from vembed.reranking import RERANKERS
from vembed.reranking.pairs import PairPart, PairScorer, as_side

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe

# The released Qwen3-VL-Reranker's system turn and default instruction (its inference code).
JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that '
         'the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
ANSWERS = ("yes", "no")  # the LM head rows whose difference scores a pair
PAIR_START = SYSTEM_START + JUDGE + USER_START + "<Instruct>: "
ENDING = ENDINGS["generation_prompt"]  # the assistant turn opened: the answer's logits are read at its last token


class QwenVLRerankerSettings(QwenVLModelSettings):
    # The `<Instruct>:` of every pair (a query Side's own instruction wins); the released default unless set.
    instruction: str = DEFAULT_INSTRUCTION
    # Pairs encoded per forward chunk, as the cross-encoder's (chunks are activation-checkpointed).
    pairs_per_chunk: int | None = Field(default=None, gt=0)

    unsaved: ClassVar[frozenset[str]] = QwenVLModelSettings.unsaved | {"pairs_per_chunk", "normalize"}


@RERANKERS.register("qwen_vl_reranker")
class QwenVLReranker(PairScorer, QwenVLModel):
    """`preprocess(queries, documents)` -> CPU tensors, `forward(inputs)` -> (n,) float "yes"-vs-"no" logits,
    `score(queries, documents)`, `save`/`load`: the reranker contract of vembed/reranking/cross_encoder.py."""

    model_type: ClassVar[str] = "qwen_vl_reranker"
    task: ClassVar[str] = "rerank"
    Settings: ClassVar[type[QwenVLRerankerSettings]] = QwenVLRerankerSettings
    auto_class: ClassVar[str] = "AutoModelForImageTextToText"  # the model with its LM head
    card_library: ClassVar[str] = "transformers"  # final/ is a plain ForConditionalGeneration folder

    @classmethod
    def card_usage(cls, path: str) -> list[str]:
        """vembed's lines with an image document, then what plain transformers needs to score as vembed does."""
        from vembed.reranking.pairs import EXAMPLE_QUERY

        return ["With vembed (`pip install vembed`); documents are texts, or `Side`s holding images (paths or PIL "
                "images):", "", "```python", "from vembed.data.records import Side",
                "from vembed.reranking import load_reranker", f"reranker = load_reranker({path!r})",
                f"scores = reranker.score([{EXAMPLE_QUERY!r}] * 2, ['Sort the integers in ascending order.', "
                "Side(image='page.png')])  # higher ranks first", "```", "",
                "With plain transformers: the folder is a Qwen-VL ForConditionalGeneration checkpoint "
                f"(`AutoModelForImageTextToText.from_pretrained({path!r})`, the tokenizer beside it). A pair's score "
                "is the last position's \"yes\" logit minus its \"no\" logit on the released Qwen3-VL-Reranker "
                "chat template (the sigmoid of it: the released model's relevance probability); vembed builds that "
                "prompt (`QwenVLReranker.pair_prompt`)."]

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: Any,
                 settings: QwenVLRerankerSettings):
        if model.get_output_embeddings() is None:
            raise RecipeError("model_name", f"{type(model).__name__} has no LM head; the reranker scores with its "
                                            '"yes" and "no" rows')
        super().__init__(model, tokenizer, image_processor, settings)
        self._answer_ids: tuple[int, int] | None = None
        self._kept_ids: set[int] = set()
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
            missing = [answer for answer in ANSWERS if answer not in vocab]
            if missing:
                raise RecipeError("tokenizer_name", f"has no single token {' or '.join(map(repr, missing))}; the "
                                                    "reranker reads the LM head rows of 'yes' and 'no': use the "
                                                    "checkpoint's own tokenizer")
            self._answer_ids = (vocab["yes"], vocab["no"])
            # What truncation never cuts (the released code keeps every special token): template and image tokens.
            self._kept_ids = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}

    @staticmethod
    def backbone_of(model: "PreTrainedModel") -> Any:
        return model.model  # ForConditionalGeneration: the Qwen-VL model under the LM head

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        super().check_recipe(recipe)
        cls.hf_config(cls.settings_of(recipe))  # the config only: a checkpoint without an LM head fails here

    @classmethod
    def check_config(cls, config: "PretrainedConfig", key: str) -> None:
        super().check_config(config, key)
        architectures = getattr(config, "architectures", None)
        if architectures and not any(name.endswith("ForConditionalGeneration") for name in architectures):
            raise RecipeError(key, f"is a {', '.join(architectures)} checkpoint, saved without an LM head; the "
                                   'reranker scores with the LM head\'s "yes" and "no" rows: start from a '
                                   "ForConditionalGeneration checkpoint (Qwen/Qwen3-VL-Reranker-2B, "
                                   "Qwen/Qwen3-VL-2B-Instruct)")

    def planning_tokens(self, recipe: "Recipe") -> dict[str, dict[str, int]]:
        """One route, `pair`: a document sequence (`planned_document`: one image at max_pixels, its text) plus a text
        query, within max_length when set."""
        document = self.planned_document(recipe)
        text = document["text"] if self.settings_of(recipe).max_length is not None else (
            document["text"] + PLANNED_TEXT_TOKENS)
        return {"pair": {"text": text, "image": document["image"]}}

    # --- the pair template -----------------------------------------------------------------------------------------
    def pair_prompt(self, query: "Side", document: "Side") -> str:
        """The pair's sequence as text, one `<|image_pad|>` per image (before expansion)."""
        instruction = query.instruction or self.settings.instruction
        return (PAIR_START + instruction + "<Query>:" + image_placeholders(query) + side_text(query) + "\n<Document>:"
                + image_placeholders(document) + side_text(document) + ENDING)

    def _truncate(self, ids: list[int]) -> list[int]:
        """At most max_length tokens, as the released code cuts: the ending kept, and before it every special token
        (template, images) with the first of the other tokens that fit (so the document's text goes first)."""
        limit = self.settings.max_length
        if limit is None or len(ids) <= limit:
            return ids
        ending = len(self._encode_text(ENDING))
        body, tail = ids[:-ending], ids[-ending:]
        fixed = ending + sum(token in self._kept_ids for token in body)
        room = limit - fixed
        if room < 0:
            raise ValueError(f"a pair's template and images alone take {fixed} tokens, over max_length {limit}; raise "
                             "max_length or lower max_pixels")
        kept = []
        for token in body:
            if token in self._kept_ids:
                kept.append(token)
            elif room > 0:
                kept.append(token)
                room -= 1
        return kept + tail

    def preprocess(self, queries: Sequence[PairPart], documents: Sequence[PairPart]) -> dict[str, torch.Tensor]:
        """The pairs' sequences (padded, with their images' pixels): the family's batch layout, one row per pair."""
        pairs = [(as_side(query, "query"), as_side(document, "document")) for query, document in
                 zip(queries, documents)]

        def pair_ids(i: int, tokens_per_image: list[int]) -> list[int]:
            ids = self._encode_text(self.pair_prompt(*pairs[i]))
            return self._truncate(self._expand_images(ids, tokens_per_image))

        return self._sequence_batch([[*query.images, *document.images] for query, document in pairs], pair_ids)

    # --- used by the task ------------------------------------------------------------------------------------------
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n,) float32 logits of "yes" against "no" at each pair's last token: h · (W_yes - W_no)."""
        last = self.last_token_states(inputs)
        if self._answer_ids is None:
            raise RuntimeError("this reranker was built on the meta device (vembed plan) and cannot score")
        yes, no = self._answer_ids
        weight = self.model.get_output_embeddings().weight
        return (last @ (weight[yes] - weight[no]).to(last.dtype)).float()

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The adapter contract's output per row: a pair's score (`forward`); a reranker embeds nothing."""
        return self.forward(inputs)

    def apply_lora(self, recipe: "Recipe") -> None:
        """LoRA on the language model, as the family's; the LM head stays frozen too: only its "yes" and "no" rows
        are read, and training it whole would train a vocabulary-sized matrix (the input embeddings, where tied)."""
        super().apply_lora(recipe)
        self.model.get_output_embeddings().requires_grad_(False)

    def write_adapter_file(self, path: str | Path) -> None:
        import json

        # A reranker has no embedding size to record (vembed.load refuses it by its model_type).
        Path(path, ADAPTER_FILE).write_text(json.dumps({"model_type": self.model_type,
                                                        "settings": self.settings_to_save()}, indent=2))
