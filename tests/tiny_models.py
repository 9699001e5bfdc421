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
