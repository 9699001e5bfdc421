"""How close generated token embeddings are to the real ones: cosine per image and per token, quality shares, a
histogram.

The per-image figure is the seed's metric: the cosine between the token-mean of the generated and of the real CLIP
tokens. The per-token figure (mean cosine over every token) is stricter.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

QUALITY_THRESHOLDS = (0.7, 0.8, 0.9)


def per_image_cosine(generated: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) cosine between the token-means of (B, N, D) generated and target tokens."""
    return F.cosine_similarity(generated.float().mean(dim=1), target.float().mean(dim=1), dim=-1)


def per_token_cosine(generated: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) mean over tokens of the cosine between matching tokens."""
    return F.cosine_similarity(generated.float(), target.float(), dim=-1).mean(dim=1)


def similarity_metrics(image_cosines: torch.Tensor, token_cosines: torch.Tensor) -> dict[str, float]:
    """Means, and the share of images whose per-image cosine is above each quality threshold."""
    metrics = {
        "image_cosine": image_cosines.mean().item(),
        "token_cosine": token_cosines.mean().item(),
        "num_samples": float(image_cosines.numel()),
    }
    for threshold in QUALITY_THRESHOLDS:
        metrics[f"share_above_{threshold}"] = (image_cosines > threshold).float().mean().item()
    return metrics


@torch.no_grad()
def evaluate_generation(
    model,
    eva: torch.Tensor,
    clip: torch.Tensor,
    *,
    sampler: str = "heun",
    num_steps: int = 50,
    seed: int = 0,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, float], torch.Tensor]:
    """Generate CLIP tokens for `eva` (n, M, De) with `model.generate` and compare them with `clip` (n, N, Dc).

    The starting noise of all n samples is drawn at once from `seed`, so the result does not depend on
    `batch_size`. Returns the metrics and the (n,) per-image cosines (for the histogram).
    """
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(clip.shape, generator=generator)
    was_training = model.training
    model.eval()
    image, token = [], []
    for start in range(0, eva.shape[0], batch_size):
        part = slice(start, start + batch_size)
        generated = model.generate(eva[part].to(device), noise=noise[part].to(device), sampler=sampler,
                                   num_steps=num_steps).cpu()
        image.append(per_image_cosine(generated, clip[part]))
        token.append(per_token_cosine(generated, clip[part]))
    model.train(was_training)
    image_cosines, token_cosines = torch.cat(image), torch.cat(token)
    return similarity_metrics(image_cosines, token_cosines), image_cosines


def plot_similarity_histogram(image_cosines: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Histogram of per-image cosines with the quality thresholds marked."""
    from vembed.evaluation.plots import _figure, _save

    fig, (ax,) = _figure(1, (6, 4))
    values = image_cosines.float().cpu().numpy()
    ax.hist(values, bins=40, range=(min(-0.05, float(values.min())) if len(values) else 0.0, 1.0), color="#4878a8")
    for threshold in QUALITY_THRESHOLDS:
        ax.axvline(threshold, color="#888888", linestyle="--", linewidth=1)
    ax.set_xlabel("cosine of token-mean embeddings (generated vs real)")
    ax.set_ylabel("images")
    mean = float(values.mean()) if len(values) else float("nan")
    ax.set_title(title or f"{len(values)} images, mean {mean:.3f}")
    return _save(fig, path)
