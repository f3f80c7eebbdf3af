"""The cost curve: throughput against image size and batch, and where attention's N^2 term starts to
matter (from ``cost_table``: the q k^T and attention-weighted-value products grow with T^2, everything
else with T)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitkit.fileio import write_file_atomic
from vitkit.models.cost import cost_table
from vitkit.models.vit import VisionTransformer


def attention_share(model: VisionTransformer, image_size: int) -> dict[str, float]:
    """Per-image forward GFLOPs at ``image_size`` and the share of them in the T^2 attention products."""
    cfg = model.cfg
    rows = cost_table(model, (image_size, image_size))
    total = sum(r.macs for r in rows)
    tokens = cfg.num_tokens(image_size)
    quadratic = cfg.depth * 2 * tokens * tokens * cfg.hidden_size  # q k^T and attn @ v, all layers
    return {
        "image_size": image_size,
        "tokens": tokens,
        "gflops": 2 * total / 1e9,
        "attention_n2_share": quadratic / total,
    }


def plot_cost_curve(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Plot img/s and achieved fraction of peak against image size, one line per (runner, batch).

    ``results`` are ``run_bench`` outputs of one model and task at several image sizes (and batches).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    shares: dict[int, float] = {}
    for res in results:
        spec = res["spec"]
        shares[spec["image_size"]] = res.get("attention_n2_share", float("nan"))
        for row in res["results"]:
            key = (row["runner"], spec["batch_size"])
            lines.setdefault(key, []).append((spec["image_size"], row["img_per_s"], row["fraction_of_peak"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (runner, batch), pts in sorted(lines.items()):
        pts.sort()
        sizes = [p[0] for p in pts]
        ax1.plot(sizes, [p[1] for p in pts], marker="o", label=f"{runner}, batch {batch}")
        ax2.plot(sizes, [100 * p[2] for p in pts], marker="o", label=f"{runner}, batch {batch}")
    ax1.set(xlabel="image size (px)", ylabel="images / s", yscale="log", title="throughput")
    ax2.set(xlabel="image size (px)", ylabel="% of peak FLOP/s", title="efficiency")
    ax2.set_ylim(bottom=0)
    for size, share in sorted(shares.items()):
        ax2.annotate(f"attn N² {100 * share:.0f}%", (size, 2), ha="center", fontsize=8)
    ax1.legend(fontsize=7)
    model = results[0]["model_name"] if results else ""
    fig.suptitle(f"{model} {results[0]['spec']['task'] if results else ''}: cost vs image size", fontsize=10)
    fig.tight_layout()
    try:
        return write_file_atomic(Path(path), lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    finally:
        plt.close(fig)
