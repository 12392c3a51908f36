#!/usr/bin/env python3
"""Plots `dsa eval --json` results: miss rate (mean and p99) against realized block sparsity.

usage: plot_eval.py RESULTS.json OUT.png
Needs matplotlib (Debian: python3-matplotlib).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(rows, kind, gamma=None):
    picked = [r for r in rows if r["kind"] == kind and (gamma is None or abs(r["exploration_fraction"] - gamma) < 1e-9)]
    picked.sort(key=lambda r: r["realized_block_sparsity"])
    return picked


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        report = json.load(f)
    rows = report["rows"]
    opts = report["options"]
    lines = []
    for gamma in opts["exploration_fractions"]:
        lines.append((f"SPIN, gamma = {gamma:g}", series(rows, "spin", gamma), "o-"))
    d = opts["draft_length"]
    if d > 0:
        lines.append((f"spec d={d}: union + prefix-valid", series(rows, "spec-union-prefix-valid"), "s--"))
        lines.append((f"spec d={d}: row-0 sharing + row-0 update", series(rows, "spec-row0"), "^--"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, key, title in ((axes[0], "mean_miss_rate", "mean miss rate"), (axes[1], "p99_miss_rate", "p99 miss rate")):
        for label, pts, style in lines:
            if not pts:
                continue
            ax.plot([p["realized_block_sparsity"] for p in pts], [p[key] for p in pts], style, label=label)
            for p in pts:
                ax.annotate(f"{p['target_sparsity']:.1f}", (p["realized_block_sparsity"], p[key]),
                            textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_xlabel("realized block sparsity (fraction of blocks skipped)")
        ax.set_ylabel(title)
        ax.set_title(f"{title} vs all-keep (labels: target rho)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SPIN on the pattern model: {opts['context_slots']}-slot prefill, "
                 f"{opts['decode_steps']} decode positions, {opts['num_layers']} layers, "
                 f"H={opts['num_heads']} D={opts['head_dim']} K={opts['top_k']}", fontsize=10)
    fig.savefig(sys.argv[2], dpi=120)


if __name__ == "__main__":
    main()
