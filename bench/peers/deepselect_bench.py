#!/usr/bin/env python3
"""Times DeepSelect's top-K (deepseek-ai/DeepSelect, a PyTorch extension, not part of this repo)
beside our top-K (dsa_kernels, python/) in one process, on the scores bench_topk_peers uses, and
writes JSON in bench_topk_peers' schema so bench/peers/report.py can merge it into the same table.

What it does, per shape (rows x slots, K 2048 by default):
  - scores: FillBellScores of bench/gpu_bench_util.cuh (a hash of the flat entry index, the sum of
    four 16-bit uniforms / 65536: ~2^18 distinct values, ties at the K-th score on long rows) or
    every score 1.0 (--scores equal), fp32 [rows, slots], slot e = entry e;
  - methods (those that run): `dsa` ours (dsa_kernels, best first, ties to the lower slot),
    `ds_fp32_sorted` DeepSelect on the fp32 scores sorted by value (its ordered output, as ours),
    `ds_fp32` DeepSelect fp32 unsorted without values (its fastest fp32 output), `ds_bf16`
    DeepSelect on the scores rounded to bf16, unsorted without values (its indexer path; a different
    input, so it is checked against torch.topk of the bf16 scores only);
  - timing: CUDA events around each launch on the current stream, a 256 MiB buffer written before
    each run (outside the events) so no run finds its data in L2, 5 warm-ups, median of 30 (us);
    outputs are allocated once, outside the timed region;
  - checks: `rows_top_k`: rows whose K slots are distinct, in range, and whose scores, as a
    multiset, equal torch.topk's K values (any choice among ties at the K-th score passes);
    `rows_same_set`: rows whose slot set equals ours (dsa), as bench_topk_peers counts it, or
    torch.topk's when dsa_kernels is not importable (then `same_set_reference` says so), or null
    where the input differs from ours (bf16).
A method that refuses a shape (an exception from its binding) gets "us": null and the reason.

DeepSelect is not built here: --deepselect-dir names a DeepSelect checkout already built in place
as its own README says (its deep_select package holding the deep_select_cuda extension), and this
script imports it.

usage: python3 bench/peers/deepselect_bench.py --deepselect-dir DEEPSELECT_DIR --out results.json
           [--shapes 1x16384,...] [--scores bell|equal] [--k 2048] [--methods dsa,ds_fp32_sorted,...]
           [--reps 30] [--warmup 5]
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import sys
import time
import types
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:  # torch is imported where it is used, so --help works without it
    import torch

DEFAULT_SHAPES = ("1x16384,1x65536,1x131072,1x1048576,8x16384,8x65536,8x131072,8x1048576,"
                  "64x16384,64x65536,64x131072,64x1048576")

METHOD_DOCS = {
    "dsa": "ours (dsa_kernels.topk over the same fp32 scores): best first, ties to the lower slot",
    "ds_fp32_sorted": "DeepSelect, fp32 scores, sorted=True (values best first, as ours), int32 slots",
    "ds_fp32": "DeepSelect, fp32 scores, unsorted, return_value=False (its fastest fp32 output)",
    "ds_bf16": "DeepSelect, the scores rounded to bf16, unsorted, return_value=False (its indexer "
               "path; checked against torch.topk of the bf16 scores)",
}
ALL_METHODS = list(METHOD_DOCS)

class BenchError(RuntimeError):
    """A setup problem this script reports as one line and exit code 2."""


# ---- DeepSelect: import a build or compile one ------------------------------------------------

def _import_prebuilt(ds_dir: str) -> Optional[types.ModuleType]:
    pattern = os.path.join(ds_dir, "deep_select", "deep_select_cuda*.so")
    if not glob.glob(pattern):
        return None
    sys.path.insert(0, os.path.abspath(ds_dir))
    try:
        return importlib.import_module("deep_select.deep_select_cuda")
    finally:
        sys.path.pop(0)


def load_deepselect(ds_dir: str):
    """The DeepSelect backend module (topk, get_alignment_requirement) and where it came from."""
    ds_dir = os.path.abspath(ds_dir)
    if not os.path.isdir(ds_dir):
        raise BenchError(f"--deepselect-dir {ds_dir} is not a folder")
    prebuilt = _import_prebuilt(ds_dir)
    if prebuilt is None:
        raise BenchError(f"no built deep_select_cuda extension under {ds_dir}/deep_select: build "
                         "DeepSelect in place first, as its README says")
    return prebuilt, f"prebuilt {prebuilt.__file__}"


# ---- scores ---------------------------------------------------------------------------------

_MIX1 = 0x9E3779B97F4A7C15
_MIX2 = 0xBF58476D1CE4E5B9


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


def _lshr(h, bits: int):
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    import torch
    return torch.bitwise_and(torch.bitwise_right_shift(h, bits), (1 << (64 - bits)) - 1)


def bell_scores(rows: int, slots: int, device) -> "torch.Tensor":
    """FillBellScores (bench/gpu_bench_util.cuh) of the flat index, fp32 [rows, slots]; int64
    arithmetic wraps as the kernel's uint64 does. Built in chunks to bound the temporaries."""
    import torch
    n = rows * slots
    out = torch.empty(n, dtype=torch.float32, device=device)
    chunk = 1 << 24
    for begin in range(0, n, chunk):
        end = min(n, begin + chunk)
        h = torch.arange(begin, end, dtype=torch.int64, device=device) * _signed64(_MIX1)
        h = torch.bitwise_xor(h, _lshr(h, 29))
        h = h * _signed64(_MIX2)
        h = torch.bitwise_xor(h, _lshr(h, 32))
        s = torch.zeros(end - begin, dtype=torch.float32, device=device)
        for j in range(4):
            part = torch.bitwise_and(torch.bitwise_right_shift(h, 16 * j), 0xFFFF)
            s += part.to(torch.float32) / 65536.0
        out[begin:end] = s
    return out.view(rows, slots)


def bell_reference(indices: List[int]) -> List[float]:
    """The same hash in plain Python integers (exact uint64), to check bell_scores."""
    mask = (1 << 64) - 1
    values = []
    for i in indices:
        h = (i * _MIX1) & mask
        h ^= h >> 29
        h = (h * _MIX2) & mask
        h ^= h >> 32
        values.append(sum(((h >> (16 * j)) & 0xFFFF) / 65536.0 for j in range(4)))
    return values


def check_bell_scores(device) -> None:
    import torch
    probe = [0, 1, 2, 3, 12345, 65535, 65536, (1 << 24) - 1, 1 << 24, (1 << 26) - 7]
    got = bell_scores(1, max(probe) + 1, device).view(-1)[torch.tensor(probe, device=device)]
    want = torch.tensor(bell_reference(probe), dtype=torch.float32)
    if not torch.equal(got.cpu(), want):
        raise BenchError(f"bell_scores disagrees with the uint64 reference: {got.tolist()} vs "
                         f"{want.tolist()}")


# ---- timing and checks ----------------------------------------------------------------------

class L2Flush:
    """A 256 MiB buffer written before each timed run, larger than any Hopper L2."""

    def __init__(self, device, nbytes: int = 256 << 20):
        import torch
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def run(self, salt: int) -> None:
        self.buffer.fill_(salt & 0xFF)


def median_us(launch: Callable[[], None], flush: L2Flush, reps: int, warmup: int) -> float:
    import torch
    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        launch()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        flush.run(i)
        start.record(stream)
        launch()
        stop.record(stream)
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2] * 1e3


def count_top_k(scores, selection, k: int) -> int:
    """Rows whose k slots are distinct, in range, and whose scores equal torch.topk's k values as a
    multiset (so any pick among ties at the k-th score counts)."""
    import torch
    rows, slots = scores.shape
    sel = selection[:, :k].to(torch.int64)
    in_range = ((sel >= 0) & (sel < slots)).all(dim=1)
    safe = sel.clamp(0, slots - 1)
    ordered = torch.sort(safe, dim=1).values
    distinct = (ordered[:, 1:] != ordered[:, :-1]).all(dim=1) if k > 1 else in_range
    got = torch.sort(torch.gather(scores, 1, safe), dim=1, descending=True).values
    want = torch.topk(scores, k, dim=1, sorted=True).values
    same_values = (got == want).all(dim=1)
    return int((in_range & distinct & same_values).sum().item())


def count_same_set(selection, reference, k: int) -> int:
    import torch
    a = torch.sort(selection[:, :k].to(torch.int64), dim=1).values
    b = torch.sort(reference[:, :k].to(torch.int64), dim=1).values
    return int((a == b).all(dim=1).sum().item())


# ---- methods --------------------------------------------------------------------------------

class Method:
    def __init__(self, name: str, prepare: Callable[[], Callable[[], None]],
                 output: Callable[[], "torch.Tensor"], check_input: str):
        self.name = name
        self.prepare = prepare          # -> the launch closure (allocates outputs once)
        self.output = output            # the slots [rows, >= k] after a launch
        self.check_input = check_input  # "fp32" (the scores) or "bf16" (the rounded copy)


def _aligned_empty(rows: int, cols: int, dtype, device, align_bytes: int):
    """[rows, cols] with a row stride padded to align_bytes, as DeepSelect's outputs want."""
    import torch
    item = torch.empty(0, dtype=dtype).element_size()
    per = max(1, align_bytes // item)
    padded = (cols + per - 1) // per * per
    return torch.empty(rows, padded, dtype=dtype, device=device)[:, :cols]


def deepselect_methods(backend, scores, scores_bf16, k: int) -> Dict[str, Method]:
    import torch
    rows, _ = scores.shape
    device = scores.device
    out_align = int(backend.get_alignment_requirement()[1])
    state: Dict[str, dict] = {}

    def make(name: str, inp, sorted_value: bool, return_value: bool) -> Method:
        def prepare():
            idx = _aligned_empty(rows, k, torch.int32, device, out_align)
            val = _aligned_empty(rows, k, inp.dtype, device, out_align) if return_value else None
            state[name] = {"idx": idx}

            def launch():
                # topk(input, k, begin, end, sorted_value, sorted_index, output_value, output_index,
                #      output_idx_offset, idx_oob_fill_value, value_oob_fill_value, return_value,
                #      abort_when_nan_found)
                backend.topk(inp, k, None, None, sorted_value, False, val, idx, None,
                             2147483647, float("-inf"), return_value, True)
            return launch
        return Method(name, prepare, lambda: state[name]["idx"],
                      "bf16" if inp.dtype == torch.bfloat16 else "fp32")

    return {
        "ds_fp32_sorted": make("ds_fp32_sorted", scores, True, True),
        "ds_fp32": make("ds_fp32", scores, False, False),
        "ds_bf16": make("ds_bf16", scores_bf16, False, False),
    }


def ours_method(dk, scores, k: int) -> Method:
    import torch
    rows, slots = scores.shape
    device = scores.device
    state = {}

    def prepare():
        offsets = torch.arange(rows, dtype=torch.int64, device=device) * slots
        entries = torch.full((rows,), slots, dtype=torch.int64, device=device)
        max_slot = torch.full((rows,), slots - 1, dtype=torch.int64, device=device)
        sel = torch.empty(rows, k, dtype=torch.int32, device=device)
        state["sel"] = sel

        def launch():
            # The host bound on the rows' entries, as bench_topk_peers passes it and as every
            # peer is told the rows' length.
            kind, message = dk._C.topk_into(scores, offsets, entries, max_slot, k, None, None, sel,
                                            slots)
            if kind != 0:
                raise RuntimeError(message)
        return launch
    return Method("dsa", prepare, lambda: state["sel"], "fp32")


def first_launch(method: Method, slots: int, k: int):
    """Prepares `method` for rows of `slots` entries and runs it once (K above slots is refused).
    Returns (launch, None, None) when it ran; (None, reason, None) when it refused the shape;
    (None, reason, sticky) when the refusal also left a CUDA error, which poisons this process's
    context: the caller must stop."""
    import torch
    try:
        if slots < k:
            raise ValueError(f"slots {slots} < K {k}")
        launch = method.prepare()
        launch()
        torch.cuda.synchronize()
        return launch, None, None
    except Exception as e:  # the method refused the shape
        reason = f"{type(e).__name__}: {e}".strip()[:400]
        try:
            torch.cuda.synchronize()
        except Exception as sticky:  # a device error poisons the context
            return None, reason, str(sticky)
        return None, reason, None


# ---- main -----------------------------------------------------------------------------------

def parse_shapes(text: str, multiple_of: int = 1):
    """(item, rows, slots) of each ROWSxSLOTS in a comma list; BenchError for a bad item, a
    non-positive count, or slots that are not a multiple of `multiple_of`."""
    shapes = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            rows, slots = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise BenchError(f"--shapes: '{item}' is not ROWSxSLOTS") from None
        if multiple_of > 1 and (rows < 1 or slots < multiple_of or slots % multiple_of):
            raise BenchError(f"--shapes: '{item}': rows must be >= 1 and slots a positive multiple "
                             f"of {multiple_of}")
        if rows < 1 or slots < 1:
            raise BenchError(f"--shapes: '{item}' must be positive")
        shapes.append((item, rows, slots))
    return shapes


def cuda_torch():
    """torch, after checking that it imports and sees a CUDA device (BenchError otherwise)."""
    try:
        import torch
    except ImportError:
        raise BenchError("PyTorch is not importable here; run this on the GPU host") from None
    if not torch.cuda.is_available():
        raise BenchError("torch sees no CUDA device")
    return torch


def run(args) -> dict:
    torch = cuda_torch()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_DOCS]
    if unknown:
        raise BenchError(f"--methods: unknown {unknown}; known: {ALL_METHODS}")
    methods = [m for m in ALL_METHODS if m in methods]  # ours first: it is the same-set reference
    device = torch.device("cuda", torch.cuda.current_device())
    prop = torch.cuda.get_device_properties(device)
    if prop.major != 9:
        print(f"warning: {prop.name} is sm_{prop.major}{prop.minor}; DeepSelect is built for sm_90a "
              "here", file=sys.stderr)

    dk = None
    ours_error = None
    if "dsa" in methods:
        try:
            import dsa_kernels as dk  # noqa: F811 - python/ built with setup.py build_ext --inplace
        except ImportError as e:
            ours_error = f"dsa_kernels not importable ({e}); build python/ and put it on PYTHONPATH"
            print(f"warning: {ours_error}", file=sys.stderr)

    backend, how = None, None
    ds_error = None
    if any(m.startswith("ds_") for m in methods):
        try:
            backend, how = load_deepselect(args.deepselect_dir)
        except BenchError:
            raise
        except Exception as e:  # a compiler or loader failure: report it, keep ours
            ds_error = f"DeepSelect failed to build or load: {type(e).__name__}: {e}"
            print(ds_error, file=sys.stderr)

    if args.scores == "bell":
        check_bell_scores(device)
    flush = L2Flush(device)
    k = args.k
    results = []
    print(f"{prop.name}, {prop.multi_processor_count} SMs; K {k}, {args.scores} scores; "
          f"medians of {args.reps} (us), L2 flushed; DeepSelect: {how or ds_error or 'not run'}")
    print(f"{'shape':<10} {'method':<16} {'us':>9} {'vs dsa':>8} {'same set':>14} {'a top-K':>11}")
    for shape, rows, slots in parse_shapes(args.shapes):
        if args.scores == "bell":
            scores = bell_scores(rows, slots, device)
        else:
            scores = torch.ones(rows, slots, dtype=torch.float32, device=device)
        scores_bf16 = scores.to(torch.bfloat16)
        table: Dict[str, Method] = {}
        if "dsa" in methods and dk is not None:
            table["dsa"] = ours_method(dk, scores, k)
        if backend is not None:
            for name, method in deepselect_methods(backend, scores, scores_bf16, k).items():
                if name in methods:
                    table[name] = method
        reference = None
        reference_name = "dsa" if "dsa" in table else "torch.topk"
        ours_us = None
        for name in methods:
            entry = {"shape": shape, "rows": rows, "slots": slots, "method": name, "us": None,
                     "rows_same_set": None, "rows_top_k": None}
            method = table.get(name)
            if method is None:
                entry["refused"] = ours_error if name == "dsa" else (ds_error or "not built")
                results.append(entry)
                print(f"{shape:<10} {name:<16} {'not run':>9}")
                continue
            launch, refused, sticky = first_launch(method, slots, k)
            if refused is not None:
                entry["refused"] = refused
                if sticky is not None:  # the context is poisoned: stop here
                    raise BenchError(f"{name} on {shape} left a CUDA error: {sticky}")
                results.append(entry)
                print(f"{shape:<10} {name:<16} {'refused':>9} ({entry['refused'][:80]})")
                continue
            selection = method.output()
            check_scores = scores_bf16.float() if method.check_input == "bf16" else scores
            entry["rows_top_k"] = count_top_k(check_scores, selection, k)
            if method.check_input == "fp32":
                if name == "dsa":
                    reference = selection[:, :k].clone()
                if reference is None:
                    reference = torch.topk(scores, k, dim=1).indices
                entry["rows_same_set"] = count_same_set(selection, reference, k)
                entry["same_set_reference"] = reference_name
            entry["us"] = round(median_us(launch, flush, args.reps, args.warmup), 2)
            if name == "dsa":
                ours_us = entry["us"]
            ratio = f"{entry['us'] / ours_us:7.2f}x" if ours_us else f"{'':>8}"
            same = ("n/a" if entry["rows_same_set"] is None
                    else f"{entry['rows_same_set']} of {rows}")
            print(f"{shape:<10} {name:<16} {entry['us']:9.1f} {ratio} {same:>14} "
                  f"{entry['rows_top_k']:>5} of {rows:<3}", flush=True)
            results.append(entry)
        del scores, scores_bf16, table
        torch.cuda.empty_cache()
    return {
        "device": prop.name,
        "k": k,
        "scores": args.scores,
        "source": "bench/peers/deepselect_bench.py",
        "torch": torch.__version__,
        "deepselect": how or ds_error,
        "timing": f"median of {args.reps} after {args.warmup} warm-ups, CUDA events, 256 MiB "
                  "written before each run",
        "methods": {m: METHOD_DOCS[m] for m in methods},
        "results": results,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepselect-dir", required=True,
                        help="a DeepSelect checkout built in place (its deep_select package)")
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxSLOTS,... (default: %(default)s)")
    parser.add_argument("--scores", choices=["bell", "equal"], default="bell")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--methods", default=",".join(ALL_METHODS),
                        help="comma list of %s (default: all)" % ", ".join(ALL_METHODS))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if not 1 <= args.k <= 4096:
        parser.error("--k must be in [1, 4096] (DeepSelect's limit)")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    try:
        report = run(args)
    except BenchError as e:
        print(f"deepselect_bench: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
