#!/usr/bin/env python3
"""Turns bench_topk_peers' JSON (bench/peers/run_peers.sh) into the markdown report of
docs/results/: a section a score kind and K, with a table of ours and FlashInfer's modes, a row a
shape, each method's median and its ratio to ours (peer / dsa: above 1 means ours is faster), and
whether its selection was the same set as ours and a top-K. Standard library only.

--extra adds JSON in the same schema from another harness (bench/peers/deepselect_bench.py,
topk_frameworks_bench.py: peers timed in Python processes beside our top-K): a table for each of
its peers (a method belongs to the peer whose name prefixes it) in the section of the same score
kind and K. A peer's ratio is to ours timed in that peer's own process (the harness's
dsa_us_same_process), else to the extra's `dsa` row, else to bench_topk_peers'; that time is the
table's "dsa, same process" column. A check that does not apply (null) reads "n/a".

--scan adds the scan's peer (bench/peers/deepgemm_bench.py: DeepGEMM's fp8_paged_mqa_logits beside
our scan, each shape in one child process): a table of its own, each method's median, its share of
the HBM floor, DeepGEMM's time over ours, and each method's largest relative error against the
float64 reference; a method that did not run reads "refused" with the first reason under the
table.

usage: python3 bench/peers/report.py OUT/topk_peers_bell.json [OUT/topk_peers_equal.json ...]
           [--extra OUT/deepselect_bell.json ...] [--scan OUT/deepgemm_bench.json]
           --commit SHA --markdown docs/results/topk_peers_h200.md
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


def _peer_groups(extra: dict) -> List[Tuple[str, List[Tuple[str, str]]]]:
    """An extra report's methods other than ours by peer, in its order: a method belongs to the
    peer whose name prefixes it ("vllm_cooperative": vllm), else to the harness's one peer."""
    peers = list(extra.get("peers") or {})
    whole = "DeepSelect" if "deepselect" in extra else _extra_label(extra)
    groups: Dict[str, List[Tuple[str, str]]] = {}
    for m, d in _extra_methods(extra):
        group = max((p for p in peers if m.startswith(p + "_")), key=len, default=whole)
        groups.setdefault(group, []).append((m, d))
    return list(groups.items())


def _by_shape(results: List[dict]) -> Dict[str, Dict[str, dict]]:
    by_shape: Dict[str, Dict[str, dict]] = {}
    for r in results:
        by_shape.setdefault(r["shape"], {})[r["method"]] = r
    return by_shape


def _head(ours_column: str, methods: List[Tuple[str, str]]) -> List[str]:
    """A top-K table's header and rule: the shape, ours, then each method's three columns."""
    head = f"| rows x slots | {ours_column} | " + " | ".join(
        f"{m} (us) | {m} / dsa | {m} checks" for m, _ in methods) + " |"
    return [head, "|" + "---|" * (2 + 3 * len(methods))]


def _method_cells(r: Optional[dict], base: Optional[float], absent: str) -> List[str]:
    """A method's time, its ratio to `base` (ours; none without it) and its checks; "refused"
    for a result without a time, `absent` for no result."""
    if r is None or r["us"] is None:
        return ["refused" if r is not None else absent, "", ""]
    return ["%.1f" % r["us"], "%.2fx" % (r["us"] / base) if base else "", _checks(r)]


def table(report: dict) -> List[str]:
    """bench_topk_peers' table: a row a shape, ours and each FlashInfer mode."""
    lines = _head("dsa (us)", METHODS)
    for shape, methods in _by_shape(report["results"]).items():
        ours = methods.get("dsa", {}).get("us")
        cells = [shape.replace("x", " x "), "%.1f" % ours if ours else "refused"]
        for m, _ in METHODS:
            cells += _method_cells(methods.get(m), ours, absent="refused")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def extra_table(extra: dict, methods: List[Tuple[str, str]],
                main_ours: Dict[str, float]) -> List[str]:
    """One peer's table from an extra report: a row a shape the harness ran, and each of the
    peer's `methods` with its ratio to ours. A method's base is ours as timed in its own process
    (the harness's `dsa_us_same_process`), else the extra's dsa row, else, for a harness that
    times no dsa row at all, bench_topk_peers' time on the same device (`main_ours`, by shape),
    marked "(other process)". The "dsa, same process" column shows each distinct base a ratio of
    that row used, in the methods' order."""
    lines = _head("dsa, same process (us)", methods)
    times_ours = any(r["method"] == "dsa" for r in extra["results"])
    for shape, mine in _by_shape(extra["results"]).items():
        own = mine.get("dsa", {}).get("us") if times_ours else None
        borrowed = None if times_ours else main_ours.get(shape)
        fallback = ("%.1f" % own) if own else (
            "%.1f (other process)" % borrowed if borrowed else None)
        method_cells: List[str] = []
        bases_shown: List[str] = []
        for m, _ in methods:
            r = mine.get(m)
            base = None
            if r is not None and r["us"] is not None:
                same = r.get("dsa_us_same_process")
                base = same or own or borrowed
                shown = ("%.1f" % same) if same else fallback
                if shown and shown not in bases_shown:
                    bases_shown.append(shown)
            method_cells += _method_cells(r, base, absent="not run")
        ours_cell = (" / ".join(bases_shown) if bases_shown else fallback) or (
            "refused" if "dsa" in mine else "not run")
        if any(m in mine for m, _ in methods):
            lines.append("| " + " | ".join([shape.replace("x", " x "), ours_cell] + method_cells)
                         + " |")
    return lines


def _short_reason(reason: str) -> str:
    """A refusal's reason up to its captured output (the Python stack a crash printed)."""
    return reason.split("; last output:")[0].strip()


# deepgemm_bench.py's methods that time a step beside the scan, not a scan: no floor, no ratio.
SCAN_SIDE_METHODS = {"deepgemm_metadata"}


def scan_table(scan: dict) -> List[str]:
    """The scan's peer as markdown: a row a shape, ours and each peer method."""
    by_shape: Dict[str, Dict[str, dict]] = {}
    floors: Dict[str, float] = {}
    results = scan.get("results") or []
    for r in results:
        by_shape.setdefault(r["shape"], {})[r["method"]] = r
        if r.get("floor_us") is not None:
            floors[r["shape"]] = r["floor_us"]
    methods_seen = [m for m in (scan.get("methods") or {}) if m != "dsa"] or sorted(
        {r["method"] for r in results} - {"dsa"})
    # A method that produces no scores (DeepGEMM's schedule) gets its time only.
    side = {m for m in methods_seen if m in SCAN_SIDE_METHODS}
    peers = [m for m in methods_seen if m not in side]
    head = "| rows x slots | floor (us) | dsa (us) | dsa % of floor | dsa max rel err |"
    for m in peers:
        head += f" {m} (us) | {m} % of floor | {m} / dsa | {m} max rel err |"
    for m in methods_seen:
        if m in side:
            head += f" {m} (us) |"
    lines = [head, "|" + "---|" * (5 + 4 * len(peers) + len(side))]
    reasons: Dict[str, str] = {}

    def err(r: dict) -> str:
        e = r.get("max_rel_err")
        return "%.1e" % e if e is not None else "n/a"

    for shape, methods in by_shape.items():
        floor = floors.get(shape)
        ours = methods.get("dsa", {})
        ours_us = ours.get("us")
        cells = [shape.replace("x", " x "), "%.2f" % floor if floor else "?"]
        if ours_us:
            cells += ["%.1f" % ours_us, "%.0f %%" % (100 * floor / ours_us) if floor else "?",
                      err(ours)]
        else:
            cells += ["refused" if ours else "not run", "", ""]
            if ours.get("refused"):
                reasons.setdefault("dsa", _short_reason(ours["refused"]))
        for m in peers:
            r = methods.get(m, {})
            us = r.get("us")
            if us is None:
                cells += ["refused" if r else "not run", "", "", ""]
                if r.get("refused"):
                    reasons.setdefault(m, _short_reason(r["refused"]))
                continue
            cells += ["%.1f" % us, "%.0f %%" % (100 * floor / us) if floor else "?",
                      "%.2fx" % (us / ours_us) if ours_us else "", err(r)]
        for m in methods_seen:
            if m not in side:
                continue
            r = methods.get(m, {})
            cells.append("%.1f" % r["us"] if r.get("us") is not None else
                         ("refused" if r else "not run"))
            if r and r.get("us") is None and r.get("refused"):
                reasons.setdefault(m, _short_reason(r["refused"]))
        lines.append("| " + " | ".join(cells) + " |")
    if reasons:
        lines.append("")
        lines += [f"- `{m}` refused (first reason): {why}" for m, why in reasons.items()]
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
    parser.add_argument("--scan", metavar="PATH",
                        help="bench/peers/deepgemm_bench.py's JSON: the scan against DeepGEMM")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--markdown", required=True)
    args = parser.parse_args()
    if not args.reports and not args.extra and not args.scan:
        parser.error("give at least one report (positional), --extra or --scan")
    reports = [_load(p) for p in args.reports]
    extras = [_load(p) for p in args.extra]
    # A section a score kind and K: bench_topk_peers' table, then a table for each peer of the
    # extras of the same kind and K.
    sections: Dict[Tuple[str, int], dict] = {}
    for kind, inputs in (("reports", reports), ("extras", extras)):
        for data in inputs:
            section = sections.setdefault((data["scores"], data["k"]),
                                          {"device": data["device"], "reports": [], "extras": []})
            section[kind].append(data)
    out = []
    for (scores, k), section in sections.items():
        out += [f"## {scores} scores, K {k} ({section['device']})", ""]
        main_ours: Dict[Tuple[str, str], float] = {}  # by (device, shape)
        for report in section["reports"]:
            out += ["### FlashInfer 0.7.4 (`bench_topk_peers`)", ""] + table(report) + [""]
            for r in report["results"]:
                if r["method"] == "dsa" and r["us"]:
                    main_ours.setdefault((report["device"], r["shape"]), r["us"])
        for extra in section["extras"]:
            same_device = {shape: us for (device, shape), us in main_ours.items()
                           if device == extra["device"]}
            for group, methods in _peer_groups(extra):
                out += [f"### {group} (`{_extra_label(extra)}`)", ""]
                out += extra_table(extra, methods, same_device) + [""]
    peers = (["FlashInfer 0.7.4"] if reports else []) + list(
        dict.fromkeys(group for extra in extras
                      for group in ([g for g, _ in _peer_groups(extra)] or [_extra_label(extra)])))
    named = ", ".join(peers[:-1]) + " and " + peers[-1] if len(peers) > 1 else "".join(peers)
    header = [f"# Top-K against {named}, in the same run", ""]
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
            f"Tables from `{extra.get('source', label)}` ({extra.get('device', '?')}, "
            f"{extra['scores']} scores{_extra_versions(extra)}): "
            f"{extra.get('timing', 'its own timing')}; each peer's `/ dsa` is to our top-K timed "
            "in that peer's own process (its table's \"dsa, same process\" column) where it ran. "
            "\"top-K\" there also "
            "requires the K scores to equal torch.topk's as a multiset; \"n/a\": not comparable "
            "(another input).",
            "",
            "Methods: " + "; ".join(f"`{m}`: {d}" for m, d in _extra_methods(extra)) + ".",
            "",
        ]
    if args.scan:
        scan = _load(args.scan)
        dg = scan.get("deepgemm") or {}
        version = " ".join(str(v) for v in (dg.get("version"), (dg.get("commit") or "")[:7]) if v)
        out += [f"## The scan against DeepGEMM's paged fp8 logits ({scan.get('device', '?')})", "",
                f"`{scan.get('source', 'deepgemm_bench.py')}` (DeepGEMM {version or '?'}; H "
                f"{scan.get('heads', '?')}, D {scan.get('head_dim', '?')}): "
                f"{scan.get('timing', 'its own timing')}. Queries: {scan.get('queries', '?')}. "
                f"Floor: {scan.get('floor', '?')}. Methods: "
                + "; ".join(f"`{m}`: {d}" for m, d in (scan.get("methods") or {}).items()) + ".",
                ""]
        out += scan_table(scan) + [""]
        if not reports and not extras:
            header = ["# The scan against DeepGEMM, in the same run", ""]
    with open(args.markdown, "w", encoding="utf-8") as f:
        f.write("\n".join(header + out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
