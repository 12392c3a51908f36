"""Draws the loss-curve JSON of `train_indexer.py` to a PNG: the training loss per step (raw and a
moving average) and the held-out KL of the periodic evaluations against tokens seen, both as the
sum over layers of the per-position KL (docs/model.md, "Training").

    python3 python/dsa_model/plot_loss.py loss.json loss.png

Needs only the standard library and matplotlib (it imports nothing of dsa_model)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over up to `window` values: a list as long as `values`."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(log: dict, png_path: str) -> None:
    """Writes the figure of one training log (train_indexer.py's JSON) to png_path. Raises
    ValueError when the log has neither training steps nor held-out points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, heldout = log.get("train") or [], log.get("heldout") or []
    if not train and not heldout:
        raise ValueError("the log has no training steps and no held-out points")
    cfg = log.get("config", {})
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if train:
        x = [r["tokens"] for r in train]
        y = [r["loss"] for r in train]
        ax.plot(x, y, color="tab:blue", alpha=0.25, linewidth=0.8,
                label=f"train loss, T = {cfg.get('seq_len', '?')} (step)")
        ax.plot(x, moving_average(y, max(1, len(y) // 50)), color="tab:blue", linewidth=1.6,
                label="train loss (moving average)")
    if heldout:
        ax.plot([r["tokens"] for r in heldout], [r["kl"] for r in heldout], "o-",
                color="tab:red", linewidth=1.6, markersize=4,
                label=f"held-out KL, T = {cfg.get('eval_seq_len', '?')}")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("KL summed over layers (nats per position)")
    ax.set_yscale("log")
    result = log.get("result") or {}
    ax.set_title(f"lightning indexer dense warm-up: {cfg.get('device_name', '?')}, "
                 f"seq {cfg.get('seq_len', '?')} x batch {cfg.get('batch', '?')}, "
                 f"{result.get('steps', len(train))} steps", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: LOSS_JSON PNG. Returns 1 on an unreadable or empty log or without
    matplotlib."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="train_indexer.py's --log JSON")
    ap.add_argument("png", help="output image")
    args = ap.parse_args(argv)
    try:
        with open(args.log) as f:
            log = json.load(f)
        plot(log, args.png)
    except (OSError, ValueError, ImportError) as err:
        print(f"plot_loss: {args.log}: {err}", file=sys.stderr)
        return 1
    print(f"plot_loss: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
