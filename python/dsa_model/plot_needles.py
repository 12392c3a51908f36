"""Draws the pass-key (needle retrieval) results of `dsa eval --model smollm2 --json` reports as
a heat map per arm: a grid of small multiples, x = context length (1K, 2K, ... as present),
y = needle depth (0 = start of the haystack, 1 = right before the question), each cell coloured
by the fraction of its cases whose key was found (1 green, 0 red) and annotated "found/cases".

    python -m dsa_model.plot_needles REPORT.json [REPORT2.json ...] --out FILE.png [--title T]
    python -m dsa_model.plot_needles REPORT.json ... --text     (markdown: arm x length)

Input: the report's `needles` array of cells {"arm": str, "length": int (tokens), "depth":
float in [0, 1], "found": bool, "generated": [ids]} and `options.arms` (the arms in order, each
a name or an object with a "name"). The cells of all the reports are merged; a cell (same arm,
length and depth) present in two reports is taken from the later file, and stderr says so.
Panels follow the first report's `options.arms` (then arms only later reports name); arms with
no needle cells are left out. A report with an empty `needles` array (pass keys skipped) adds
nothing. Exit status 0; 2 on bad input (a file missing, not JSON, without `needles`, a malformed
cell, or no needle cells in any file), with one line naming the file and the problem; 1 when
matplotlib is missing. Needs matplotlib for the PNG only (`--text` is standard library)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

Key = Tuple[str, int, float]  # (arm, length, depth)


class ReportError(Exception):
    """Bad input: the message names the file and the problem."""


@dataclass
class Merged:
    """The needle cells of several reports after merging."""

    arms: List[str]  # panel order; only arms with cells
    lengths: List[int]  # sorted, over all arms (the panels share their axes)
    depths: List[float]  # sorted, over all arms
    counts: Dict[Key, Tuple[int, int]]  # (found, cases)
    notes: List[str] = field(default_factory=list)  # for stderr: files replacing others' cells


def load_report(path: str) -> dict:
    """Reads one report and checks its needle cells; raises ReportError naming the file."""
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except OSError as err:
        raise ReportError(f"{path}: cannot read: {err.strerror}") from None
    except ValueError as err:  # JSONDecodeError and bad UTF-8 alike
        raise ReportError(f"{path}: not JSON: {err}") from None
    if not isinstance(report, dict) or "needles" not in report:
        raise ReportError(f"{path}: no 'needles' key (not a `dsa eval --model smollm2` report)")
    cells = report["needles"]
    if not isinstance(cells, list):
        raise ReportError(f"{path}: 'needles' is not a list")
    options = report.get("options", {})
    if not isinstance(options, dict) or not isinstance(options.get("arms", []), list):
        raise ReportError(f"{path}: 'options' is not an object with an 'arms' list")
    if report.get("complete") is False:
        # A run stopped early (dsa eval writes each finished cell): its cells are whole.
        print(f"plot_needles: {path}: a partial report (the run stopped before its last cell)",
              file=sys.stderr)
    for i, c in enumerate(cells):
        ok = (isinstance(c, dict) and isinstance(c.get("arm"), str)
              and isinstance(c.get("length"), int) and not isinstance(c.get("length"), bool)
              and isinstance(c.get("depth"), (int, float)) and not isinstance(c.get("depth"), bool)
              and isinstance(c.get("found"), bool))
        if not ok:
            raise ReportError(f"{path}: needles[{i}] lacks arm (str), length (int), depth "
                              f"(number) or found (bool): {json.dumps(c)[:120]}")
    return report


def arm_names(report: dict) -> List[str]:
    """options.arms as names: the eval writes objects with a "name"; plain strings are taken too."""
    arms = (report.get("options") or {}).get("arms") or []
    return [a if isinstance(a, str) else a.get("name", "") for a in arms
            if isinstance(a, (str, dict))]


def merge(reports: Sequence[Tuple[str, dict]]) -> Merged:
    """Merges the needle cells of (path, report) pairs, later files winning per (arm, length,
    depth). Several cases of one cell within one report add up. Pure: no I/O."""
    counts: Dict[Key, Tuple[int, int]] = {}
    source: Dict[Key, str] = {}
    notes: List[str] = []
    for path, report in reports:
        mine: Dict[Key, Tuple[int, int]] = {}
        for c in report["needles"]:
            key = (c["arm"], c["length"], float(c["depth"]))
            found, cases = mine.get(key, (0, 0))
            mine[key] = (found + int(c["found"]), cases + 1)
        # One note per earlier file rather than one per cell: a rerun replaces whole lengths.
        replaced: Dict[str, int] = {}
        for key in mine:
            if key in source:
                replaced[source[key]] = replaced.get(source[key], 0) + 1
            source[key] = path
        counts.update(mine)
        notes += [f"{path} replaces {n} needle cell(s) of {old} (same arm, length and depth)"
                  for old, n in replaced.items()]
    order: List[str] = []
    for name in [n for _, r in reports for n in arm_names(r)] + [k[0] for k in counts]:
        if name not in order:
            order.append(name)
    present = {k[0] for k in counts}
    return Merged(arms=[a for a in order if a in present],
                  lengths=sorted({k[1] for k in counts}),
                  depths=sorted({k[2] for k in counts}),
                  counts=counts, notes=notes)


def fraction_grid(merged: Merged, arm: str) -> List[List[Optional[float]]]:
    """One arm's panel: rows = merged.depths, columns = merged.lengths, the fraction of cases
    found, None where the arm has no case."""
    grid = []
    for d in merged.depths:
        row = []
        for n in merged.lengths:
            fc = merged.counts.get((arm, n, d))
            row.append(None if fc is None else fc[0] / fc[1])
        grid.append(row)
    return grid


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def text_table(merged: Merged) -> str:
    """Markdown: one row per arm, one column per length, "found/cases" over the depths."""
    lines = ["| arm | " + " | ".join(length_label(n) for n in merged.lengths) + " |",
             "|---|" + "---:|" * len(merged.lengths)]
    for arm in merged.arms:
        row = []
        for n in merged.lengths:
            fcs = [fc for (a, ln, _), fc in merged.counts.items() if a == arm and ln == n]
            row.append(f"{sum(f for f, _ in fcs)}/{sum(c for _, c in fcs)}" if fcs else "-")
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(merged: Merged, png_path: str, title: str) -> None:
    """Writes the small-multiples figure to png_path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(merged.arms)
    ncols = min(n, 5)
    nrows = math.ceil(n / ncols)
    nx, ny = len(merged.lengths), len(merged.depths)
    # Panels sized from the grid so a 3 x 5 panel stays readable and a 1 x 1 one stays small.
    w, h = 0.55 * nx + 1.2, 0.32 * ny + 1.0
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols + 1.0, h * nrows + 0.8),
                             squeeze=False, sharex=True, sharey=True)
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd")  # grey: no case of this arm
    image = None
    for ax, arm in zip(axes.flat, merged.arms):
        grid = np.array([[np.nan if v is None else v for v in row]
                         for row in fraction_grid(merged, arm)], dtype=float)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0,
                          aspect="auto", interpolation="nearest")
        for yi, d in enumerate(merged.depths):
            for xi, length in enumerate(merged.lengths):
                fc = merged.counts.get((arm, length, d))
                # White on the colour map's dark ends (all found / none found), black between.
                dark = fc is not None and abs(fc[0] / fc[1] - 0.5) > 0.3
                ax.text(xi, yi, "-" if fc is None else f"{fc[0]}/{fc[1]}", ha="center",
                        va="center", fontsize=7, color="white" if dark else "black")
        ax.set_title(textwrap.fill(arm, 30), fontsize=8)
        ax.set_xticks(range(nx), [length_label(v) for v in merged.lengths], fontsize=7)
        ax.set_yticks(range(ny), [f"{d:g}" for d in merged.depths], fontsize=7)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("context length (tokens)", fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("needle depth", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.94, 1))
    cax = fig.add_axes((0.955, 0.15, 0.012, 0.7))
    fig.colorbar(image, cax=cax).set_label("fraction found", fontsize=7)
    cax.tick_params(labelsize=7)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsa_model.plot_needles",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="`dsa eval --model smollm2 --json` reports")
    ap.add_argument("--out", help="PNG to write")
    ap.add_argument("--title", help="figure title (default: from the reports' devices)")
    ap.add_argument("--text", action="store_true",
                    help="print a markdown table arm x length -> found/cases")
    args = ap.parse_args(argv)
    if not args.out and not args.text:
        ap.error("give --out FILE.png, --text, or both")
    try:
        reports = [(p, load_report(p)) for p in args.reports]
    except ReportError as err:
        print(f"plot_needles: {err}", file=sys.stderr)
        return 2
    merged = merge(reports)
    if not merged.counts:
        print(f"plot_needles: {', '.join(args.reports)}: no needle cells at all "
              "(pass keys skipped in every report?)", file=sys.stderr)
        return 2
    for path, report in reports:
        if not report["needles"]:
            print(f"plot_needles: {path}: no needle cells (adds nothing)", file=sys.stderr)
    for note in merged.notes:
        print(f"plot_needles: {note}", file=sys.stderr)
    if args.text:
        sys.stdout.write(text_table(merged))
    if args.out:
        devices = sorted({str(r.get("device", "?")) for _, r in reports})
        title = args.title or f"pass-key retrieval per arm (found/cases), {', '.join(devices)}"
        try:
            plot(merged, args.out, title)
        except ImportError as err:
            print(f"plot_needles: no matplotlib ({err}); --text needs none", file=sys.stderr)
            return 1
        except OSError as err:
            print(f"plot_needles: {args.out}: cannot write: {err.strerror}", file=sys.stderr)
            return 1
        print(f"plot_needles: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
