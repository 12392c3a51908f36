#!/usr/bin/env python3
"""Turns bench_topk_peers' JSON (bench/peers/run_peers.sh) into the markdown report of
docs/results/: one table a score kind, a row a shape, each peer's median and its ratio to ours
(peer / dsa: above 1 means ours is faster), and whether its selection was the same set as ours
and a top-K. Standard library only.

usage: python3 bench/peers/report.py OUT/topk_peers_bell.json [OUT/topk_peers_equal.json ...]
           --commit SHA --markdown docs/results/topk_peers_h200.md
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

METHODS = [("fi_exact", "FlashInfer exact (deterministic, ties to the lower slot)"),
           ("fi_fast", "FlashInfer fast radix (non-deterministic)"),
           ("fi_clusters_exact", "FlashInfer cluster top-K (exact)")]


def table(report: dict) -> List[str]:
    by_shape: Dict[str, Dict[str, dict]] = {}
    for r in report["results"]:
        by_shape.setdefault(r["shape"], {})[r["method"]] = r
    head = "| rows x slots | dsa (us) | " + " | ".join(
        f"{m} (us) | {m} / dsa | {m} checks" for m, _ in METHODS) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(METHODS))]
    for shape, methods in by_shape.items():
        ours = methods.get("dsa", {}).get("us")
        cells = [shape.replace("x", " x "), "%.1f" % ours if ours else "refused"]
        for m, _ in METHODS:
            r = methods.get(m)
            if r is None or r["us"] is None:
                cells += ["refused", "", ""]
                continue
            rows = r["rows"]
            same = "same set" if r["rows_same_set"] == rows else f"same set {r['rows_same_set']}/{rows}"
            top = "top-K" if r["rows_top_k"] == rows else f"top-K {r['rows_top_k']}/{rows}"
            cells += ["%.1f" % r["us"], "%.2fx" % (r["us"] / ours) if ours else "", f"{same}, {top}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--markdown", required=True)
    args = parser.parse_args()
    out = []
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        out += [f"## {report['scores']} scores, K {report['k']} ({report['device']})", ""]
        out += table(report) + [""]
    header = [
        "# Top-K against FlashInfer 0.7.4, in one process",
        "",
        f"`bench_topk_peers` (bench/peers/) on binaries of commit {args.commit}: medians of 30 "
        "CUDA-event timings after 5 warm-ups, the L2 flushed before each. `peer / dsa` above 1 "
        "means ours is faster. \"same set\": the slots equal ours (DSA's rule: ties to the lower "
        "slot); \"top-K\": K distinct slots all scoring at least the K-th score (right up to how "
        "ties are broken). Ours returns the K best in order; the FlashInfer modes were run "
        "unsorted, their faster output.",
        "",
        "Methods: " + "; ".join(f"`{m}`: {d}" for m, d in METHODS) + ".",
        "",
    ]
    with open(args.markdown, "w", encoding="utf-8") as f:
        f.write("\n".join(header + out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
