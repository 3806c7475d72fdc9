"""Heatmap export of the measured matrix (PNG through matplotlib's Agg backend)."""

from __future__ import annotations

import numpy as np

__all__ = ["write_heatmap"]


def write_heatmap(matrix: np.ndarray, path: str, *, title: str = "") -> None:
    """Writes ``matrix`` (bytes/s, NaN = not measured) as a PNG heatmap in Gbit/s."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gbps = np.asarray(matrix, dtype=float) * 8 / 1e9
    n = gbps.shape[0]
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * n, 1.0 + 0.5 * n))
    im = ax.imshow(np.ma.masked_invalid(gbps), cmap="viridis")
    for i in range(n):
        for j in range(n):
            if not np.isnan(gbps[i, j]):
                ax.text(j, i, f"{gbps[i, j]:.0f}", ha="center", va="center", fontsize=7, color="w")
    ax.set_xlabel("receiver GPU (diagonal: intra-node injection)")
    ax.set_ylabel("sender GPU")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="Gbit/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
