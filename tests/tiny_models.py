"""Tiny model configs shared by tests (a plain module: `conftest` is ambiguous across test folders)."""

TINY_CLIP_CONFIG = {
    "projection_dim": 16,
    "text_config": {
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 2,
        "eos_token_id": 3, "dropout": 0.1,
    },
    "vision_config": {
        "image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "dropout": 0.1,
    },
}

# Text hidden size 48 (the embedding size) differs from the vision tower's 32 on purpose.
_QWEN_TEXT = {
    "vocab_size": 320, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None,
}  # fmt: skip
_MROPE = {"type": "mrope", "mrope_section": [2, 2, 2]}
_QWEN_VISION = {"depth": 2, "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
QWEN_BACKBONES = {
    "qwen2_vl": {
        "text_config": {**_QWEN_TEXT, "rope_scaling": _MROPE},
        "vision_config": {**_QWEN_VISION, "embed_dim": 32, "hidden_size": 48, "mlp_ratio": 2},
    },
    "qwen2_5_vl": {
        "text_config": {**_QWEN_TEXT, "rope_scaling": _MROPE},
        "vision_config": {**_QWEN_VISION, "hidden_size": 32, "out_hidden_size": 48, "intermediate_size": 64,
                          "window_size": 16, "fullatt_block_indexes": [1]},
    },
    "qwen3_vl": {
        "text_config": {**_QWEN_TEXT, "head_dim": 12, "rope_scaling": {
            "rope_type": "default", "mrope_section": [2, 2, 2], "mrope_interleaved": True}},
        "vision_config": {**_QWEN_VISION, "hidden_size": 32, "out_hidden_size": 48, "intermediate_size": 64,
                          "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
    },
}
QWEN_MODEL_CLASSES = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel", "qwen3_vl": "Qwen3VLModel"}
QWEN_PIXELS = {"min_pixels": 64, "max_pixels": 1024}  # tiny images stay tiny: at most 16 image tokens each


def tiny_clip_run(data_dir, output_dir, **changes) -> dict:
    """A short tiny-CLIP run on `data_dir` (the dummy data and its tokenizer) that checkpoints every 2 steps: the
    recipe the checkpoint and output-folder tests damage, repeat and resume."""
    raw = {
        "model_type": "clip", "model_config": TINY_CLIP_CONFIG, "tokenizer_name": str(data_dir / "tokenizer"),
        "data": {"train": str(data_dir / "train.jsonl")}, "output_dir": str(output_dir), "batch_size": 8,
        "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "eval_before_training": False,
        "max_steps": 4, "save_steps": 2, "save_total_limit": 2,
    }
    return {**raw, **changes}



def hashing_encoder():
    """A stand-in adapter for search and mining tests: a side's embedding is a fixed random projection of its
    characters (weighted by position), so top-k lists differ between texts; `rows_encoded` counts forwarded rows."""
    import torch

    class HashingEncoder(torch.nn.Module):
        embedding_dim = 6

        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(1)
            self.weight = torch.nn.Parameter(torch.randn(128, self.embedding_dim, generator=generator))
            self.rows_encoded = 0

        def preprocess(self, sides):
            codes = torch.zeros(len(sides), 128)
            for row, side in enumerate(sides):
                for position, char in enumerate(side.text):
                    codes[row, ord(char) % 128] += 1.0 / (1 + position)
            return {"codes": codes}

        def forward(self, inputs):
            self.rows_encoded += len(inputs["codes"])
            return inputs["codes"] @ self.weight

    return HashingEncoder()


def save_transformers_folder(path, tokenizer_dir: str, seed: int = 0) -> str:
    """A tiny random-init BERT with its tokenizer, saved by transformers alone (no vembed.json, no modules.json)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from vembed.data.tokenizer import special_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = special_token_ids(tokenizer)
    torch.manual_seed(seed)
    config = BertConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                        max_position_embeddings=16, **ids)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_sentence_transformers_folder(path, transformers_dir: str, pooling: str = "cls", normalize: bool = True,
                                      max_seq_length: int = 8) -> str:
    """`transformers_dir` as a sentence-transformers model (Transformer -> Pooling [-> Normalize]) saved at `path`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(transformers_dir, max_seq_length=max_seq_length)
    modules = [transformer, Pooling(32, pooling_mode=pooling), *([Normalize()] if normalize else [])]
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return str(path)


def save_cross_encoder_folders(root, tokenizer_dir: str) -> dict[str, str]:
    """Two rerankers vembed did not save, as their libraries write them: a transformers one-logit
    BertForSequenceClassification folder, and that model saved by sentence-transformers' CrossEncoder."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from vembed.data.tokenizer import special_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                        max_position_embeddings=16, num_labels=1, **special_token_ids(tokenizer))
    transformers_dir = f"{root}/transformers-cross-encoder"
    BertForSequenceClassification(config).save_pretrained(transformers_dir)
    tokenizer.save_pretrained(transformers_dir)
    st_dir = f"{root}/st-cross-encoder"
    CrossEncoder(transformers_dir, device="cpu", local_files_only=True).save(st_dir)
    return {"transformers": transformers_dir, "sentence-transformers": st_dir}

# model_type vision's CNN and hierarchical backbones at image size 32, stochastic depth off (Swin's default is 0.1,
# EfficientNet's 0.2): a final stage of width 16 (EfficientNet: hidden_dim, which must be round_filters(1280) at its
# width_coefficient: 128 at 0.1). ResNet's config has no image size; 32 is kept as an extra key.
_CONVNEXT = {"hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2, "image_size": 32, "drop_path_rate": 0.0}
_SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 8, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4,
         "drop_path_rate": 0.0}
VISION_BACKBONES = {
    "convnext": {"model_type": "convnext", **_CONVNEXT},
    "convnextv2": {"model_type": "convnextv2", **_CONVNEXT},
    "resnet": {"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
               "layer_type": "basic", "image_size": 32},
    # one block per stage but the second's two: only a repeated block has a drop-connect (skip) path
    "efficientnet": {"model_type": "efficientnet", "image_size": 32, "width_coefficient": 0.1, "depth_coefficient": 1.0,
                     "num_block_repeats": [1, 2, 1, 1, 1, 1, 1], "hidden_dim": 128, "drop_connect_rate": 0.0},
    "swin": {"model_type": "swin", **_SWIN},
    "swinv2": {"model_type": "swinv2", **_SWIN},
}
VISION_BACKBONE_WIDTHS = {"convnext": 16, "convnextv2": 16, "resnet": 16, "efficientnet": 128, "swin": 16, "swinv2": 16}
