#!/usr/bin/env python3
"""gpu_report: the results table and plot of one H200 benchmark run (DESIGN.md 7).

Reads the JSON of one run of
  bench_gpu_indexer   (bench/gpu_indexer_bench.cu: scan, top-K, HBM floor)   --kernels
  bench_gpu_select    (bench/gpu_select_bench.cu: the whole select, SPIN)    --select
  torch_peer_indexer.py (bench/: the PyTorch peer)                         --torch
and writes a markdown report (--markdown) and a PNG (--plot). --check validates the inputs and
writes nothing; it exits 1 on malformed input. Every target verdict is computed from the data.

usage: /usr/bin/python3 bench/gpu_report.py --kernels gpu_bench.json --select select.json \
           --torch torch_reference.json [--commit SHA] [--title TEXT] \
           [--markdown OUT.md] [--plot OUT.png] [--check]
Standard library and matplotlib only (Debian's python3-matplotlib).
"""
import argparse
import json
import math
import sys

SPIN_RHO = 0.4
SPIN_TARGET = 0.70


class InputError(Exception):
    """Malformed or missing input: the message names the file and what is wrong."""


def shape_label(rows, slots):
    if slots % (1 << 20) == 0:
        s = f"{slots >> 20}M"
    elif slots % 1024 == 0:
        s = f"{slots >> 10}K"
    else:
        s = str(slots)
    return f"{rows}x{s}"


def _load(path, flag):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputError(f"{flag} {path}: no such file")
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot read ({e.strerror})")
    except json.JSONDecodeError as e:
        raise InputError(f"{flag} {path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})")


def _num(row, key, where, positive=True, required=True):
    if key not in row:
        if required:
            raise InputError(f"{where}: field '{key}' missing")
        return None
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InputError(f"{where}: field '{key}' is {v!r}, not a finite number")
    if positive and v <= 0:
        raise InputError(f"{where}: field '{key}' is {v}, not > 0")
    return float(v)


def _shape(row, where):
    for key in ("rows", "slots"):
        v = row.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(f"{where}: field '{key}' is {v!r}, not a positive integer")
    return row["rows"], row["slots"]


def _results(doc, path, flag):
    if not isinstance(doc, dict):
        raise InputError(f"{flag} {path}: expected an object with 'copy_tb_s' and 'results'")
    copy = _num(doc, "copy_tb_s", f"{flag} {path}")
    res = doc.get("results")
    if not isinstance(res, list) or not res:
        raise InputError(f"{flag} {path}: 'results' missing, not a list, or empty")
    for i, r in enumerate(res):
        if not isinstance(r, dict):
            raise InputError(f"{flag} {path}: results[{i}] is not an object")
    return copy, res


def load_kernels(path):
    flag = "--kernels"
    copy, res = _results(_load(path, flag), path, flag)
    out = {}
    for i, r in enumerate(res):
        where = f"{flag} {path}: results[{i}]"
        shape = _shape(r, where)
        where = f"{flag} {path}: shape {shape_label(*shape)}"
        if shape in out:
            raise InputError(f"{where}: listed twice")
        row = {k: _num(r, k, where) for k in ("floor_us", "scan_tensor_core_us", "topk_us")}
        for k in ("scan_tensor_core_workspace_us", "scan_cuda_core_us",
                  "scan_tensor_core_code_warm_us", "topk_code_warm_us"):
            row[k] = None if r.get(k) is None else _num(r, k, where)
        out[shape] = row
    return copy, out


def load_select(path):
    flag = "--select"
    copy, res = _results(_load(path, flag), path, flag)
    out = {}  # shape -> {"all-keep": row, "spin": {rho: row}}
    for i, r in enumerate(res):
        where = f"{flag} {path}: results[{i}]"
        shape = _shape(r, where)
        where = f"{flag} {path}: shape {shape_label(*shape)}"
        mode = r.get("mode")
        if mode not in ("all-keep", "spin"):
            raise InputError(f"{where}: results[{i}] mode is {mode!r}, not 'all-keep' or 'spin'")
        rho = _num(r, "rho", where, positive=False)
        if not 0 <= rho < 1:
            raise InputError(f"{where}: results[{i}] rho is {rho}, not in [0, 1)")
        row = {"select_us": _num(r, "select_us", where),
               "floor_us": _num(r, "floor_us", where),
               "sparsity": _num(r, "realized_sparsity", where, positive=False),
               "rho": rho,
               "code_warm_us": (None if r.get("select_code_warm_us") is None
                                else _num(r, "select_code_warm_us", where))}
        if not 0 <= row["sparsity"] <= 1:
            raise InputError(f"{where}: realized_sparsity {row['sparsity']} not in [0, 1]")
        entry = out.setdefault(shape, {"all-keep": None, "spin": {}})
        if mode == "all-keep":
            if entry["all-keep"] is not None:
                raise InputError(f"{where}: two all-keep rows")
            entry["all-keep"] = row
        else:
            key = round(rho, 4)
            if key in entry["spin"]:
                raise InputError(f"{where}: two spin rows at rho {rho:g}")
            entry["spin"][key] = row
    return copy, out


def load_torch(path):
    flag = "--torch"
    doc = _load(path, flag)
    if not isinstance(doc, list) or not doc:
        raise InputError(f"{flag} {path}: expected a non-empty list of rows "
                         "(torch_peer_indexer.py --json)")
    out, notes = {}, []
    for i, r in enumerate(doc):
        where = f"{flag} {path}: [{i}]"
        if not isinstance(r, dict):
            raise InputError(f"{where}: not an object")
        shape = _shape(r, where)
        where = f"{flag} {path}: shape {shape_label(*shape)}"
        if shape in out:
            raise InputError(f"{where}: listed twice")
        out[shape] = {"scan_us": _num(r, "scan_us", where), "topk_us": _num(r, "topk_us", where)}
        kb = r.get("key_bytes")
        if kb is not None and kb != shape[0] * shape[1] * 132:
            notes.append(f"{where}: key_bytes {kb} is not rows x slots x 132")
    return out, notes


# ---------------------------------------------------------------------------------------------
# Derived figures


def spin_at(sel, shape, rho):
    e = sel.get(shape)
    return None if e is None else e["spin"].get(round(rho, 4))  # load_select's keys


def build(kern, sel, torch, paths):
    shapes = sorted(set(kern) | set(sel) | set(torch))
    rows, missing = [], []
    for s in shapes:
        k, e, t = kern.get(s), sel.get(s), torch.get(s)
        lab = shape_label(*s)
        for name, d in (("--kernels", k), ("--select", e), ("--torch", t)):
            if d is None:
                missing.append(f"shape {lab}: absent from {name} {paths[name]}")
        ak = e["all-keep"] if e else None
        sp = spin_at(sel, s, SPIN_RHO)
        if e is not None and ak is None:
            missing.append(f"shape {lab}: no all-keep row in --select {paths['--select']}")
        if e is not None and sp is None:
            missing.append(f"shape {lab}: no spin rho {SPIN_RHO} row in --select {paths['--select']}")
        r = {"shape": s, "label": lab,
             "floor": k["floor_us"] if k else None,
             "scan": k["scan_tensor_core_us"] if k else None,
             "topk": k["topk_us"] if k else None,
             "t_scan": t["scan_us"] if t else None,
             "t_topk": t["topk_us"] if t else None,
             "allkeep": ak["select_us"] if ak else None,
             "spin": sp["select_us"] if sp else None,
             "scan_cw": k.get("scan_tensor_core_code_warm_us") if k else None,
             "topk_cw": k.get("topk_code_warm_us") if k else None,
             "allkeep_cw": ak.get("code_warm_us") if ak else None,
             "spin_cw": sp.get("code_warm_us") if sp else None}
        r["pct_floor"] = 100 * r["floor"] / r["scan"] if k else None
        r["scan_x"] = r["t_scan"] / r["scan"] if k and t else None
        r["topk_x"] = r["t_topk"] / r["topk"] if k and t else None
        r["spin_ratio"] = r["spin"] / r["allkeep"] if ak and sp else None
        r["t_both"] = r["t_scan"] + r["t_topk"] if t else None
        r["select_x"] = r["t_both"] / r["allkeep"] if t and ak else None
        rows.append(r)
    sweeps = []
    for s in sorted(sel):
        e = sel[s]
        if len(e["spin"]) > 1:
            sweeps.append((s, e))
    return rows, sweeps, missing


def fmt(v, spec=".1f", suffix=""):
    return "–" if v is None else f"{v:{spec}}{suffix}"


def fmt_us(v):
    if v is None:
        return "–"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def targets(rows):
    by = {r["shape"]: r for r in rows}
    out = []

    def at(shape, key, fname):
        r = by.get(shape)
        if r is None or r[key] is None:
            return None, f"not measured: shape {shape_label(*shape)} absent from {fname}"
        return r[key], None

    def le(name, shape, key, fname, limit, unit, what):
        v, why = at(shape, key, fname)
        if v is None:
            out.append((name, "–", "not measured", why))
            return
        ok = v <= limit
        if unit == "x":
            meas = f"{v:.2f}x"
            gap = (f"{limit - v:.2f} under the limit" if ok else
                   f"{v - limit:.2f} over: needs {v / limit:.2f}x less {what}")
        else:
            meas = f"{v:.1f} {unit}"
            gap = (f"{limit - v:.1f} {unit} under ({v / limit:.2f}x the limit)" if ok else
                   f"{v - limit:.1f} {unit} over ({v / limit:.2f}x the limit)")
        out.append((name, meas, "met" if ok else "missed", gap))

    # scan >= 90 % of the floor at 64 x 64K
    v, why = at((64, 65536), "pct_floor", "--kernels")
    if v is None:
        out.append(("scan >= 90 % of the HBM floor at 64x64K", "–", "not measured", why))
    else:
        r = by[(64, 65536)]
        need = r["floor"] / 0.9
        gap = (f"{v - 90:.1f} points above" if v >= 90 else
               f"{90 - v:.1f} points short: {r['scan']:.1f} us, needs <= {need:.1f} us "
               f"({r['scan'] / need:.2f}x faster)")
        out.append(("scan >= 90 % of the HBM floor at 64x64K",
                    f"{v:.1f} % ({r['scan']:.1f} us)", "met" if v >= 90 else "missed", gap))
    le("scan <= 8 us at 1x64K", (1, 65536), "scan", "--kernels", 8.0, "us", "")
    le("top-K <= 15 us at 1x128K", (1, 131072), "topk", "--kernels", 15.0, "us", "")
    le("top-K <= 35 us at 64x64K", (64, 65536), "topk", "--kernels", 35.0, "us", "")
    le(f"SPIN rho {SPIN_RHO} <= {SPIN_TARGET:.2f}x all-keep at 1x128K", (1, 131072),
       "spin_ratio", "--select", SPIN_TARGET, "x", "time")

    for name, key, limit in (("scan >= 20x PyTorch", "scan_x", 20.0),
                             ("top-K >= 6x PyTorch", "topk_x", 6.0)):
        have = [r for r in rows if r[key] is not None]
        if not have:
            out.append((name, "–", "not measured", "no shape in both --kernels and --torch"))
            continue
        met = [r for r in have if r[key] >= limit]
        miss = [r for r in have if r[key] < limit]
        lo = min(have, key=lambda r: r[key])
        hi = max(have, key=lambda r: r[key])
        meas = f"{lo[key]:.1f}x ({lo['label']}) to {hi[key]:.1f}x ({hi['label']})"
        if not miss:
            status, gap = "met", f"at all {len(have)} shapes; lowest {lo[key]:.1f}x at {lo['label']}"
        else:
            status = "missed" if not met else f"partly met ({len(met)} of {len(have)} shapes)"
            where = ", ".join(f"{r['label']} {r[key]:.1f}x" for r in met)
            gap = ((f"met at {where}; " if met else "") + "missed at "
                   + ", ".join(f"{r['label']} {r[key]:.1f}x" for r in miss)
                   + f"; worst {lo['label']} needs {limit / lo[key]:.2f}x more")
        absent = [r["label"] for r in rows if r[key] is None]
        if absent:
            gap += "; not measured at " + ", ".join(absent)
        out.append((name, meas, status, gap))
    return out


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown(args, kcopy, scopy, rows, sweeps, tg, notes):
    L = []
    L.append(f"# {args.title}")
    L.append("")
    meta = []
    if args.commit:
        meta.append(f"commit `{args.commit}`")
    meta.append(f"device-to-device copy bandwidth of the run: {kcopy:.2f} TB/s (bench_gpu_indexer), "
                f"{scopy:.2f} TB/s (bench_gpu_select); HBM floor = 132 bytes a slot at that rate")
    L.append("; ".join(meta) + ".")
    if abs(kcopy - scopy) / kcopy > 0.05:
        L.append("")
        L.append(f"The two copy bandwidths differ by {100 * abs(kcopy - scopy) / kcopy:.0f} %: "
                 "check that both files come from the same run.")
    L.append("")
    L.append("Inputs: " + ", ".join(f"`{p}`" for p in (args.kernels, args.select, args.torch)) + ".")
    L.append("")
    L.append("| shape | floor us | scan us | % of floor | scan vs PyTorch | top-K us | "
             "top-K vs PyTorch | select all-keep us | select SPIN rho 0.4 us | SPIN / all-keep | "
             "PyTorch scan+top-K us | select vs PyTorch |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        L.append("| " + " | ".join([
            r["label"], fmt_us(r["floor"]), fmt_us(r["scan"]), fmt(r["pct_floor"], ".0f", " %"),
            fmt(r["scan_x"], ".1f", "x"), fmt_us(r["topk"]), fmt(r["topk_x"], ".1f", "x"),
            fmt_us(r["allkeep"]), fmt_us(r["spin"]), fmt(r["spin_ratio"], ".2f", "x"),
            fmt_us(r["t_both"]), fmt(r["select_x"], ".1f", "x")]) + " |")
    L.append("")
    L.append("scan: the tensor-core scan of every block (bench_gpu_indexer, L2 flushed, median); "
             "% of floor = floor / scan; top-K: K = 2048 over the row's scores. "
             "select: the whole select (plan, union, layout, scan, top-K, EMA update) replayed "
             "from a CUDA graph (bench_gpu_select); SPIN / all-keep = the two selects' times. "
             "PyTorch (torch_peer_indexer.py, same GPU): scan = fp8 -> bf16 of dense "
             "[rows, slots, 128] keys, bmm, ReLU, head weights and scale; top-K = `torch.topk` "
             "of the fp32 scores; each the median torch_peer_indexer.py reports (CUDA events, the "
             "L2 overwritten before each launch); scan+top-K is the sum of "
             "the two medians and `select vs PyTorch` divides it by the all-keep select.")
    warm = [r for r in rows if any(r[k] is not None for k in
                                   ("scan_cw", "topk_cw", "allkeep_cw", "spin_cw"))]
    if warm:
        L.append("")
        L.append("Code warm, data cold (after the L2 flush the same launch or graph ran on a twin "
                 "problem's own buffers, so the kernels' code is in L2 and the timed data is not):")
        L.append("")
        L.append("| shape | scan us | code warm | top-K us | code warm | select all-keep us | "
                 "code warm | select SPIN rho 0.4 us | code warm |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in warm:
            L.append("| " + " | ".join([r["label"]] + [fmt_us(r[k]) for k in (
                "scan", "scan_cw", "topk", "topk_cw", "allkeep", "allkeep_cw", "spin",
                "spin_cw")]) + " |")
    if notes:
        L.append("")
        for n in notes:
            L.append(f"- {n}")
    for s, e in sweeps:
        lab = shape_label(*s)
        ak = e["all-keep"]
        L.append("")
        L.append(f"## SPIN sweep at {lab}")
        L.append("")
        if ak is None:
            L.append(f"(no all-keep row at {lab} in --select: ratios not computed)")
            L.append("")
        L.append(f"all-keep: {fmt_us(ak['select_us']) if ak else '–'} us; target at rho "
                 f"{SPIN_RHO}: <= {SPIN_TARGET:.2f}x all-keep.")
        L.append("")
        L.append("| rho | select us | / all-keep | realized sparsity |")
        L.append("|---:|---:|---:|---:|")
        for rho in sorted(e["spin"]):
            row = e["spin"][rho]
            ratio = row["select_us"] / ak["select_us"] if ak else None
            L.append(f"| {rho:.2f} | {fmt_us(row['select_us'])} | {fmt(ratio, '.2f', 'x')} | "
                     f"{row['sparsity']:.3f} |")
    if not sweeps:
        L.append("")
        L.append("## SPIN sweep")
        L.append("")
        L.append("No swept shape in --select (no shape with more than one SPIN rho).")
    L.append("")
    L.append("## Targets (DESIGN.md 7)")
    L.append("")
    L.append("| target | measured | status | by how much |")
    L.append("|---|---|---|---|")
    for name, meas, status, gap in tg:
        L.append(f"| {name} | {meas} | {status} | {gap} |")
    L.append("")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------
# Plot


def plot(path, args, kcopy, rows, sweeps):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_panels = 3 if sweeps else 2
    widths = [1.25, 1.25, 0.9][:n_panels]
    fig, axes = plt.subplots(1, n_panels, figsize=(6.2 * n_panels, 5.6),
                             gridspec_kw={"width_ratios": widths})
    labels = [r["label"] for r in rows]
    xs = list(range(len(rows)))

    def bars(ax, series, title, ylabel):
        """Grouped bars, one group a shape; returns where series i's bar of shape x stands."""
        n = len(series)
        w = 0.8 / n
        for i, (name, key, color) in enumerate(series):
            have = [(x, r[key]) for x, r in zip(xs, rows) if r[key] is not None]
            pos = [x - 0.4 + w * (i + 0.5) for x, _ in have]
            ax.bar(pos, [v for _, v in have], w, label=name, color=color, edgecolor="black",
                   linewidth=0.4)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=10)
        ax.set_xlabel("rows x slots", fontsize=10)
        ax.set_ylabel(ylabel, fontsize=10)
        ax.set_title(title, fontsize=11)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=9, loc="upper left")
        return lambda x, i: x - 0.4 + w * (i + 0.5)

    def ratio_labels(ax, pos, i, value_key, label_key, spec, suffix, color):
        """Series i's bars labelled with row[label_key] (format spec, then suffix) above
        row[value_key]."""
        for x, r in zip(xs, rows):
            if r[label_key] is not None:
                ax.annotate(format(r[label_key], spec) + suffix, (pos(x, i), r[value_key]),
                            xytext=(0, 3),
                            textcoords="offset points", ha="center", fontsize=8, color=color)

    pos = bars(axes[0], [("HBM floor (132 B a slot)", "floor", "#bbbbbb"),
                         ("scan, tensor cores (label: % of the floor)", "scan", "#1f77b4"),
                         ("PyTorch scan (label: PyTorch / ours)", "t_scan", "#ff7f0e")],
               f"Scan of every block vs the HBM floor ({kcopy:.2f} TB/s copy)",
               "time (us, log scale)")
    ratio_labels(axes[0], pos, 1, "scan", "pct_floor", ".0f", "%", "#1f77b4")
    ratio_labels(axes[0], pos, 2, "t_scan", "scan_x", ".0f", "x", "#c85a00")
    top = max([r[k] for r in rows for k in ("floor", "scan", "t_scan") if r[k]] or [1])
    axes[0].set_ylim(top=top * 4)

    pos = bars(axes[1], [("top-K (K = 2048)", "topk", "#2ca02c"),
                         ("PyTorch top-K (label: PyTorch / ours)", "t_topk", "#98df8a"),
                         ("select, all-keep", "allkeep", "#9467bd"),
                         (f"select, SPIN rho {SPIN_RHO}", "spin", "#c5b0d5"),
                         ("PyTorch scan + top-K (label: / all-keep select)", "t_both", "#ff7f0e")],
               "Top-K and the whole select vs PyTorch", "time (us, log scale)")
    ratio_labels(axes[1], pos, 1, "t_topk", "topk_x", ".1f", "x", "#2a7a2a")
    ratio_labels(axes[1], pos, 4, "t_both", "select_x", ".1f", "x", "#c85a00")
    top = max([r[k] for r in rows for k in ("topk", "t_topk", "allkeep", "spin", "t_both") if r[k]]
              or [1])
    axes[1].set_ylim(top=top * 6)

    if sweeps:
        ax = axes[2]
        seen = []
        for s, e in sweeps:
            ak = e["all-keep"]
            if ak is None:
                continue
            rhos = sorted(e["spin"])
            ratios = [e["spin"][r]["select_us"] / ak["select_us"] for r in rhos]
            seen += ratios
            ax.plot(rhos, ratios, "o-", color="#9467bd", label=f"SPIN / all-keep at {shape_label(*s)}")
            for r, q in zip(rhos, ratios):
                ax.annotate(f"{q:.2f}x\n(sparsity {e['spin'][r]['sparsity']:.2f})", (r, q),
                            xytext=(0, 8), textcoords="offset points", ha="center", fontsize=8)
        ax.axhline(SPIN_TARGET, color="red", linestyle="--",
                   label=f"target at rho {SPIN_RHO}: {SPIN_TARGET:.2f}x")
        ax.axhline(1.0, color="gray", linestyle=":", label="all-keep (1.0x)")
        ax.axvline(SPIN_RHO, color="red", alpha=0.25, linewidth=6)
        ax.set_xlabel("rho (SPIN's target block sparsity)", fontsize=10)
        ax.set_ylabel("select time / all-keep select time", fontsize=10)
        ax.set_title("SPIN: whole select vs all-keep", fontsize=11)
        lo, hi = min([SPIN_TARGET] + seen), max([1.0] + seen)
        ax.set_ylim(lo - 0.1, hi + 0.15)
        ax.set_xlim(-0.05, max(0.6, max(max(e["spin"]) for _, e in sweeps) + 0.1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="lower left")

    title = args.title + (f" ({args.commit})" if args.commit else "")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", required=True, help="bench_gpu_indexer --json output")
    ap.add_argument("--select", required=True, help="bench_gpu_select --json output")
    ap.add_argument("--torch", required=True, help="torch_peer_indexer.py --json output")
    ap.add_argument("--commit", help="commit the binaries were built from")
    ap.add_argument("--title", default="DSA indexer on the H200: scan, top-K and the whole select")
    ap.add_argument("--markdown", help="write the tables here")
    ap.add_argument("--plot", help="write the PNG here (150 dpi)")
    ap.add_argument("--check", action="store_true",
                    help="validate the inputs only; exit 1 on malformed input, write nothing")
    args = ap.parse_args(argv)
    if not args.check and not args.markdown and not args.plot:
        ap.error("nothing to do: give --markdown and/or --plot, or --check")
    try:
        kcopy, kern = load_kernels(args.kernels)
        scopy, sel = load_select(args.select)
        torch, notes = load_torch(args.torch)
    except InputError as e:
        print(f"gpu_report: {e}", file=sys.stderr)
        return 1
    paths = {"--kernels": args.kernels, "--select": args.select, "--torch": args.torch}
    rows, sweeps, missing = build(kern, sel, torch, paths)
    tg = targets(rows)
    for m in missing + notes:
        print(f"gpu_report: warning: {m}", file=sys.stderr)
    if args.check:
        print(f"gpu_report: inputs OK: {len(kern)} shapes in --kernels, {len(sel)} in --select, "
              f"{len(torch)} in --torch; {len(sweeps)} swept shape(s); "
              f"{len(missing)} missing entr{'y' if len(missing) == 1 else 'ies'}")
        return 0
    try:
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(markdown(args, kcopy, scopy, rows, sweeps, tg, missing + notes))
        if args.plot:
            plot(args.plot, args, kcopy, rows, sweeps)
    except OSError as e:
        print(f"gpu_report: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
