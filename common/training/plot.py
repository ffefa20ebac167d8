"""The training curves of 04 as a PNG: per-TTT-step loss and accuracy and the simulated acceptance
length, train (lines, one point per log interval) and held-out eval (markers), from train_log.jsonl;
with checkpoint selection, the candidates' replay tau on the selection split and the chosen one."""
from __future__ import annotations

from pathlib import Path

from common.io import atomic_path, iter_jsonl


def plot_training_curves(log_path: str | Path, out_png: str | Path, chosen_step: int | None = None) -> Path:
    """Write `out_png` from 04's train log; returns its path. Needs at least one train row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(iter_jsonl(log_path))
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    select = [r for r in rows if r["split"] == "select"]
    assert train, f"{log_path} has no train rows"
    num_steps = len(train[0]["acc"])
    colors = plt.get_cmap("viridis")([k / max(num_steps - 1, 1) for k in range(num_steps)])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, key, title in ((axes[0], "loss", "soft cross-entropy per TTT step"),
                           (axes[1], "acc", "accuracy per TTT step (draft argmax = target argmax)")):
        for k in range(num_steps):
            ax.plot([r["step"] for r in train], [r[key][k] for r in train], color=colors[k], lw=1.2,
                    label=f"k={k}")
            if evals:
                ax.plot([r["step"] for r in evals], [r[key][k] for r in evals], "o", color=colors[k], ms=5,
                        markeredgecolor="black", markeredgewidth=0.6)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2, title="lines: train, dots: eval", title_fontsize=8)
    axes[1].set_ylim(0, 1)
    axes[2].plot([r["step"] for r in train], [r["tau"] for r in train], color="tab:blue", label="train")
    if evals:
        axes[2].plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", color="tab:orange", label="eval")
    if select:  # over-training shows here: replay tau falls while the simulated one still rises
        k = select[0]["num_draft_tokens"]
        axes[2].plot([r["step"] for r in select], [r["replay_tau"] for r in select], "s--", color="tab:green",
                     label=f"replay tau, selection split (k={k})")
        chosen = [r for r in select if r["step"] == chosen_step]
        if chosen:
            axes[2].plot([chosen[0]["step"]], [chosen[0]["replay_tau"]], "*", color="red", ms=14,
                         label=f"exported: step {chosen_step}")
    axes[2].set_title("acceptance length: simulated 1 + sum_k prod acc_j" + (", replay" if select else ""))
    axes[2].set_xlabel("optimizer step")
    axes[2].grid(alpha=0.3)
    axes[2].legend()
    fig.tight_layout()
    out_png = Path(out_png)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return out_png
