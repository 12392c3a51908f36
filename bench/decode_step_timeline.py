#!/usr/bin/env python3
"""Draws one recorded decode step of bench_gpu_decode_step (its --json output) as a timeline.

Two lanes per arm: the attention stream (the sparse MLA decode, then the layer stand-in) and the
indexer stream (the select), from the per-layer CUDA events the bench recorded; one row of panels
per arm, one column per shape, the first --layers layers of the step.

usage: decode_step_timeline.py RESULTS.json [--out docs/decode_step_timeline_h200.png]
                               [--shapes 1x131072,64x65536] [--arms serial_keep,mli_keep_eq,...]
                               [--layers 6]
"""

import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Per layer, microseconds from the step's start (bench/gpu_decode_step_bench.cu, ReadTimeline).
LAYER_START, ATTENTION_START, ATTENTION_END, LAYER_END, SELECT_START, SELECT_END = range(6)

COLORS = {"attention": "#1f77b4", "standin": "#aec7e8", "select": "#d62728", "wait": "#dddddd"}


def finite(*values):
    return all(v is not None and not math.isnan(v) for v in values)


def draw(ax, arm, layers, title):
    timeline = arm["timeline_us"][:layers]
    serial = arm["arm"].startswith("serial")
    for layer, ev in enumerate(timeline):
        if finite(ev[LAYER_START], ev[ATTENTION_START]) and not serial:
            # The attention stream waiting for the selection it attends (MLI's join).
            if ev[ATTENTION_START] - ev[LAYER_START] > 0.5:
                ax.broken_barh([(ev[LAYER_START], ev[ATTENTION_START] - ev[LAYER_START])], (1.1, 0.8),
                               color=COLORS["wait"], hatch="//", edgecolor="#999999")
        if finite(ev[ATTENTION_START], ev[ATTENTION_END]):
            ax.broken_barh([(ev[ATTENTION_START], ev[ATTENTION_END] - ev[ATTENTION_START])],
                           (1.1, 0.8), color=COLORS["attention"])
        if finite(ev[ATTENTION_END], ev[LAYER_END]):
            ax.broken_barh([(ev[ATTENTION_END], ev[LAYER_END] - ev[ATTENTION_END])], (1.1, 0.8),
                           color=COLORS["standin"])
            ax.text((ev[ATTENTION_END] + ev[LAYER_END]) / 2, 1.5, f"L{layer}", ha="center",
                    va="center", fontsize=7)
        if finite(ev[SELECT_START], ev[SELECT_END]):
            lane = 1.1 if serial else 0.1
            ax.broken_barh([(ev[SELECT_START], ev[SELECT_END] - ev[SELECT_START])], (lane, 0.8),
                           color=COLORS["select"])
            ax.text((ev[SELECT_START] + ev[SELECT_END]) / 2, lane + 0.4, f"S{layer}", ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks([0.5, 1.5])
    ax.set_yticklabels(["indexer stream", "attention stream"], fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("us from the step's start", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--out", default="docs/decode_step_timeline_h200.png")
    parser.add_argument("--shapes", default="1x131072,64x65536")
    parser.add_argument("--arms", default="serial_keep,mli_keep_eq,spin_mli_eq")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    with open(args.results) as f:
        results = json.load(f)
    shapes = [s for s in results["shapes"] if s["shape"] in args.shapes.split(",")]
    arm_names = args.arms.split(",")
    fig, axes = plt.subplots(len(arm_names), len(shapes), squeeze=False,
                             figsize=(6.5 * len(shapes), 1.7 * len(arm_names) + 0.8))
    for col, shape in enumerate(shapes):
        arms = {a["arm"]: a for a in shape["arms"]}
        for row, name in enumerate(arm_names):
            arm = arms[name]
            per_layer = arm["graph_layer_us"]
            draw(axes[row][col], arm, args.layers,
                 f"{shape['shape']} {name}: {per_layer:.1f} us a layer over "
                 f"{results['layers']} layers (first {args.layers} shown)")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"One decode step on {results['device']} (r = 1, k = 1, rho {results['rho']})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
