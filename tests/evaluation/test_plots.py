"""The plots write real PNGs, and return None when there is nothing to draw."""

from __future__ import annotations

from vembed.evaluation.plots import plot_loss_curve, plot_accuracy_vs_dim

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG_MAGIC) and len(data) > 1000


def test_accuracy_vs_dim_writes_a_png_for_both_directions(tmp_path):
    metrics = {"num_queries": 10.0, "q2d/accuracy@1": 0.5, "d2q/accuracy@1": 0.4}
    for dim, scale in ((16, 0.5), (32, 0.8), (64, 1.0)):
        for k, base in ((1, 0.5), (5, 0.8), (10, 0.9)):
            metrics[f"q2d/dim{dim}/accuracy@{k}"] = base * scale
            metrics[f"d2q/dim{dim}/accuracy@{k}"] = base * scale * 0.9
    out = plot_accuracy_vs_dim(metrics, tmp_path / "plots" / "accuracy.png", full_dim=128)
    assert out == tmp_path / "plots" / "accuracy.png" and _is_png(out)


def test_accuracy_vs_dim_without_mrl_metrics_draws_nothing(tmp_path):
    assert plot_accuracy_vs_dim({"q2d/accuracy@1": 0.5}, tmp_path / "r.png") is None
    assert not (tmp_path / "r.png").exists()


def test_loss_curve_with_learning_rate_and_eval_history(tmp_path):
    history = [{"step": s, "loss": 2.0 / s, "lr": 1e-4 * (1 - s / 20)} for s in range(1, 20)]
    evals = [{"step": 0, "q2d/accuracy@1": 0.1}, {"step": 10, "q2d/accuracy@1": 0.5}]
    out = plot_loss_curve(history, tmp_path / "loss.png", eval_history=evals)
    assert _is_png(out)
    assert _is_png(plot_loss_curve(history[:1], tmp_path / "one_point.png"))


def test_loss_curve_without_history_draws_nothing(tmp_path):
    assert plot_loss_curve([], tmp_path / "loss.png") is None
    assert plot_loss_curve([{"step": 1, "lr": 1e-4}], tmp_path / "loss.png") is None


def test_plots_leave_pyplot_alone(tmp_path):
    """The plots use the object API: pyplot's figure list and backend are as they were, whatever else imported it."""
    import matplotlib
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    plot_loss_curve([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}], tmp_path / "loss.png")
    plot_accuracy_vs_dim({"q2d/dim8/accuracy@1": 0.5, "q2d/dim16/accuracy@1": 0.7}, tmp_path / "recall.png")
    assert plt.get_fignums() == figures
    assert matplotlib.get_backend() == backend
