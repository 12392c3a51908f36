#!/usr/bin/env python3
"""Turns bench_topk_peers' JSON (bench/peers/run_peers.sh) into the markdown report of
docs/results/: one table a score kind, a row a shape, each peer's median and its ratio to ours
(peer / dsa: above 1 means ours is faster), and whether its selection was the same set as ours
and a top-K. Standard library only.

--extra adds JSON in the same schema from another harness (bench/peers/deepselect_bench.py:
DeepSelect, timed in a Python process beside our top-K): its methods become more columns of the
table of the same score kind and K (a table of their own if there is none). Their ratio is to the
`dsa` row of the same extra file, ours timed in that same process, where it has one; its `dsa` row
itself is shown as a column "dsa (<source>)". A check that does not apply (null) reads "n/a".

usage: python3 bench/peers/report.py OUT/topk_peers_bell.json [OUT/topk_peers_equal.json ...]
           [--extra OUT/deepselect_bell.json ...] --commit SHA --markdown docs/results/topk_peers_h200.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

METHODS = [("fi_exact", "FlashInfer exact (deterministic, ties to the lower slot)"),
           ("fi_fast", "FlashInfer fast radix (non-deterministic)"),
           ("fi_clusters_exact", "FlashInfer cluster top-K (exact)")]


def _checks(r: dict) -> str:
    rows = r["rows"]
    if r.get("rows_same_set") is None:
        same = "same set n/a"
    elif r["rows_same_set"] == rows:
        same = "same set"
    else:
        same = f"same set {r['rows_same_set']}/{rows}"
    if r.get("rows_top_k") is None:
        top = "top-K n/a"
    elif r["rows_top_k"] == rows:
        top = "top-K"
    else:
        top = f"top-K {r['rows_top_k']}/{rows}"
    return f"{same}, {top}"


def _extra_versions(extra: dict) -> str:
    """The peers' versions an extra JSON names: DeepSelect's, or each peer group's origin."""
    if "deepselect" in extra:
        return f", DeepSelect {extra.get('deepselect') or '?'}"
    origins = [f"{name}: {peer['origin']}" for name, peer in (extra.get("peers") or {}).items()
               if isinstance(peer, dict) and peer.get("origin")]
    return "; " + "; ".join(origins) if origins else ""


def _extra_label(extra: dict) -> str:
    return os.path.basename(extra.get("source", "extra")).replace(".py", "")


def _extra_methods(extra: dict) -> List[Tuple[str, str]]:
    """(name, description) of an extra report's methods other than ours, in its order."""
    described = extra.get("methods") or {}
    names = list(described) or list(dict.fromkeys(r["method"] for r in extra["results"]))
    return [(m, described.get(m, m)) for m in names if m != "dsa"]


def table(report: dict, extras: Optional[List[dict]] = None) -> List[str]:
    extras = extras or []
    by_shape: Dict[str, Dict[str, dict]] = {}
    for r in report["results"]:
        by_shape.setdefault(r["shape"], {})[r["method"]] = r
    main_shapes = set(by_shape)
    extra_by_shape: List[Dict[str, Dict[str, dict]]] = []
    for extra in extras:
        shapes: Dict[str, Dict[str, dict]] = {}
        for r in extra["results"]:
            shapes.setdefault(r["shape"], {})[r["method"]] = r
            by_shape.setdefault(r["shape"], {})
        extra_by_shape.append(shapes)
    if main_shapes:
        head = "| rows x slots | dsa (us) | " + " | ".join(
            f"{m} (us) | {m} / dsa | {m} checks" for m, _ in METHODS) + " |"
        num_cols = 2 + 3 * len(METHODS)
    else:  # only extras: no bench_topk_peers columns
        head = "| rows x slots |"
        num_cols = 1
    for extra in extras:
        if any(r["method"] == "dsa" for r in extra["results"]):
            head += f" dsa ({_extra_label(extra)}) (us) |"
            num_cols += 1
        for m, _ in _extra_methods(extra):
            head += f" {m} (us) | {m} / dsa | {m} checks |"
            num_cols += 3
    lines = [head, "|" + "---|" * num_cols]
    for shape, methods in by_shape.items():
        ours = methods.get("dsa", {}).get("us")
        cells = [shape.replace("x", " x ")]
        if main_shapes and shape not in main_shapes:  # a shape only an extra ran
            cells += ["not run"] + ["not run", "", ""] * len(METHODS)
        elif main_shapes:
            cells.append("%.1f" % ours if ours else "refused")
            for m, _ in METHODS:
                r = methods.get(m)
                if r is None or r["us"] is None:
                    cells += ["refused", "", ""]
                    continue
                cells += ["%.1f" % r["us"], "%.2fx" % (r["us"] / ours) if ours else "", _checks(r)]
        for extra, shapes in zip(extras, extra_by_shape):
            mine = shapes.get(shape, {})
            has_ours = any(r["method"] == "dsa" for r in extra["results"])
            own = mine.get("dsa", {}).get("us") if has_ours else None
            if has_ours:
                cells.append("%.1f" % own if own else "not run")
            base = own if has_ours else ours
            for m, _ in _extra_methods(extra):
                r = mine.get(m)
                if r is None:
                    cells += ["not run", "", ""]
                    continue
                if r["us"] is None:
                    cells += ["refused", "", ""]
                    continue
                # Ours timed in the peer's own process where the harness recorded it (one child a
                # peer group), else the extra's dsa row.
                mine_base = r.get("dsa_us_same_process") or base
                cells += ["%.1f" % r["us"], "%.2fx" % (r["us"] / mine_base) if mine_base else "",
                          _checks(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="*", help="bench_topk_peers --json outputs")
    parser.add_argument("--extra", action="append", default=[], metavar="PATH",
                        help="JSON of the same schema from another harness "
                             "(bench/peers/deepselect_bench.py); repeatable")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--markdown", required=True)
    args = parser.parse_args()
    if not args.reports and not args.extra:
        parser.error("give at least one report (positional) or --extra")
    reports = [_load(p) for p in args.reports]
    extras = [_load(p) for p in args.extra]
    # An extra joins the table of the same score kind and K; the rest get a table of their own.
    claimed = [False] * len(extras)
    out = []
    for report in reports:
        mine = []
        for i, extra in enumerate(extras):
            if not claimed[i] and (extra["scores"], extra["k"]) == (report["scores"], report["k"]):
                claimed[i] = True
                mine.append(extra)
        out += [f"## {report['scores']} scores, K {report['k']} ({report['device']})", ""]
        out += table(report, mine) + [""]
    for i, extra in enumerate(extras):
        if claimed[i]:
            continue
        empty = {"scores": extra["scores"], "k": extra["k"], "device": extra["device"],
                 "results": []}
        out += [f"## {extra['scores']} scores, K {extra['k']} ({extra['device']})", ""]
        out += table(empty, [extra]) + [""]
    def peer_names(extra: dict) -> str:
        if "deepselect" in extra:
            return "DeepSelect"
        return ", ".join(extra.get("peers") or {}) or _extra_label(extra)

    peers = (["FlashInfer 0.7.4"] if reports else []) + sorted(
        {peer_names(extra) for extra in extras})
    header = [f"# Top-K against {' and '.join(peers)}, in the same run", ""]
    if reports:
        header += [
            f"`bench_topk_peers` (bench/peers/) on binaries of commit {args.commit}: medians of 30 "
            "CUDA-event timings after 5 warm-ups, the L2 flushed before each. `peer / dsa` above 1 "
            "means ours is faster. \"same set\": the slots equal ours (DSA's rule: ties to the "
            "lower slot); \"top-K\": K distinct slots all scoring at least the K-th score (right "
            "up to how ties are broken). Ours returns the K best in order; the FlashInfer modes "
            "were run unsorted, their faster output.",
            "",
            "Methods: " + "; ".join(f"`{m}`: {d}" for m, d in METHODS) + ".",
            "",
        ]
    for extra in extras:
        label = _extra_label(extra)
        header += [
            f"Columns from `{extra.get('source', label)}` ({extra.get('device', '?')}, "
            f"{extra['scores']} scores{_extra_versions(extra)}): "
            f"{extra.get('timing', 'its own timing')}; their `/ dsa` is to our top-K timed in "
            f"that same process (column \"dsa ({label})\": ours in the first such process) where "
            "it ran. \"top-K\" there also "
            "requires the K scores to equal torch.topk's as a multiset; \"n/a\": not comparable "
            "(another input).",
            "",
            "Methods: " + "; ".join(f"`{m}`: {d}" for m, d in _extra_methods(extra)) + ".",
            "",
        ]
    with open(args.markdown, "w", encoding="utf-8") as f:
        f.write("\n".join(header + out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
