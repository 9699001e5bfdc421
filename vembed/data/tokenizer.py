"""Build a small word-piece tokenizer offline, for random-init models (tests and the demo).

Real users bring the tokenizer of their checkpoint; this exists so that nothing has to come from a hub.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

BOS, EOS, PAD, UNK = "<|startoftext|>", "<|endoftext|>", "<|pad|>", "<|unk|>"


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512, max_length: int = 32):
    """Train a lower-cased BPE on `texts`, wrap it as a transformers tokenizer that adds BOS/EOS, save it to `out_dir`.

    The EOS id is what CLIP-style text towers pool at, so configs built for this tokenizer must use its
    `eos_token_id` (see `special_token_ids`).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # EOS must not get id 2: CLIP text towers whose config says eos_token_id == 2 fall back to legacy argmax
        # pooling.
        special_tokens=[PAD, UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    # A pair (a cross-encoder's query and document) comes marked, BOS query EOS document EOS, and its second text
    # gets type id 1: without the pair template the two texts ran together with nothing between them.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B:1 {EOS}:1", special_tokens=[(BOS, bos), (EOS, eos)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_length,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return wrapped


def special_token_ids(tokenizer) -> dict[str, int]:
    """The ids a random-init text config must agree with (pad/bos/eos), keyed as HF configs name them."""
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "vocab_size": len(tokenizer),
    }


# The special tokens of Qwen's chat/vision vocabulary, in the order Qwen's tokenizers add them after the BPE
# vocabulary. Qwen-VL configs name the ids of the vision ones (image_token_id, vision_start_token_id, ...).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)  # fmt: skip


def train_qwen_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 400):
    """Train a byte-level BPE (as Qwen's, no lower-casing, no BOS/EOS added) with Qwen's special tokens, for
    random-init Qwen-VL models; `<|endoftext|>` pads, as in Qwen's own tokenizers. Saved to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return wrapped
