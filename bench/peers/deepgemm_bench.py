#!/usr/bin/env python3
"""Times DeepGEMM's paged fp8 indexer logits (deepseek-ai/DeepGEMM `fp8_paged_mqa_logits`, the DSA
scan that SGLang and vLLM call at decode; a PyTorch extension, not part of this repo) beside our scan
(dsa_kernels, python/), both in one child process a shape, on one paged fp8 key cache, and writes
JSON.

What it does, per shape (rows x slots; H 64 heads and D 128 by default, DeepSeek V3.2's indexer):
  - inputs: one key cache of rows * slots / 64 blocks of 64 x (D + 4) bytes, 64 x D fp8 e4m3 codes
    then 64 fp32 scales (keys randn, scale = amax / 448, as DeepGEMM's test quantizes): ours reads it
    as uint8 [blocks, 64 (D + 4)], DeepGEMM the same bytes as uint8 [blocks, 64, 1, D + 4]; each row
    is a distinct sequence of `slots` slots (DeepGEMM: batch = rows, next_n 1, context_lens [rows, 1];
    ours: one group a row), its block table a slice of a random permutation of the pool (pages
    scattered); head weights randn fp32 [rows, H]; query randn [rows, H, D], in each API's own
    precision: ours bf16, DeepGEMM fp8 e4m3 (that bf16 query cast without a scale, as DeepGEMM's
    test does). The keys, tables and weights are the same bytes for both;
  - methods: `dsa` ours (dsa_kernels._C.scan_into, tensor-core kernel, scores fp32 [rows * slots]);
    `deepgemm` fp8_paged_mqa_logits (logits fp32 [rows, slots], clean_logits False, its schedule
    from get_paged_mqa_logits_metadata computed once beforehand); `deepgemm_metadata`
    get_paged_mqa_logits_metadata alone (SGLang computes it once a batch; not in the logits time);
  - timing: CUDA events around each call on the current stream, a 256 MiB buffer written before
    each run (outside the events: no run finds its data in L2), then a ~0.25 ms GPU sleep so the
    host's enqueue time stays hidden (it is reported apart, as host_us), 5 warm-ups, median of 30,
    in us. DeepGEMM JIT-compiles its kernels on the first call, before any timing;
  - floor: rows * slots * (D + 4) bytes (every row is its own sequence: no key read is shared) over
    the device-to-device copy bandwidth of a 1 GiB torch copy (read + write bytes) measured in the
    same process; pct_of_floor = 100 * floor_us / us (100: at the floor);
  - checks: on a few rows (first, middle, last), each method's output against a float64 torch
    reference of its own query precision (dequantized keys, ReLU, head weights, key scale);
    max_rel_err = max |out - ref| / max |ref| over those rows (DeepGEMM's own test allows 1e-3);
    vs_dsa_max_rel_diff compares DeepGEMM's logits with ours (fp8 against bf16 queries: info only);
  - isolation: each shape runs in a child process (this script with --single) that rewrites its
    JSON after every stage, so a crash (C++ exceptions from extensions have segfaulted processes on
    the H200 host, python/README.md; a DeepGEMM build segfaulted in get_paged_mqa_logits_metadata)
    or a timeout costs only what had not finished; the missing methods get "us": null and the
    reason (signal, stage, the Python stack faulthandler printed). After the first crash inside
    DeepGEMM, that shape's DeepGEMM part is rerun once under gdb, where the host has it, and the
    native frames are kept as "backtrace" (that rerun's timings are not used). A method that
    refuses a shape (an exception, or an argument DeepGEMM would assert on, checked beforehand)
    also gets null and the reason.

Neither library is built here: --deepgemm-dir names a DeepGEMM tree whose deep_gemm package holds
its built _C extension and deep_gemm/include with cute/ and cutlass/ beside deep_gemm/ (the JIT
compiles with -I deep_gemm/include; bench/peers/deepgemm.sh builds one in place from the tarball
bench/peers/fetch_deepgemm.sh assembles), and --dsa-dir the
python/ folder built in place (setup.py build_ext --inplace).

usage: python3 bench/peers/deepgemm_bench.py --deepgemm-dir DEEPGEMM_DIR --out results.json
           [--dsa-dir python] [--shapes 1x16384,...] [--methods dsa,deepgemm] [--heads 64]
           [--head-dim 128] [--reps 30] [--warmup 5] [--check-rows 3] [--child-timeout-s 240]
           [--time-budget-s 0] [--deepgemm-commit SHA] [--no-gdb]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # torch is imported where it is used, so --help and the parent work without it
    import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepselect_bench as ds  # noqa: E402  (shapes, the torch check; torch imported lazily)

DEFAULT_SHAPES = "1x16384,1x65536,1x131072,1x1048576,8x65536,64x65536,64x131072"
BLOCK_SLOTS = 64
SCALE_BYTES = 4

METHOD_DOCS = {
    "dsa": "ours: dsa_kernels._C.scan_into (tensor-core kernel), bf16 queries, scores fp32",
    "deepgemm": "DeepGEMM fp8_paged_mqa_logits, fp8 e4m3 queries (the bf16 query cast), logits fp32, "
                "clean_logits False, schedule precomputed",
    "deepgemm_metadata": "DeepGEMM get_paged_mqa_logits_metadata alone (once a batch in SGLang; "
                         "not in the deepgemm time)",
}
ALL_METHODS = ["dsa", "deepgemm"]  # deepgemm also yields deepgemm_metadata
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


BenchError = ds.BenchError  # one class: the shared helpers below raise it


def parse_shapes(text: str) -> List[Tuple[str, int, int]]:
    """deepselect_bench's, the slots a multiple of a cache block (the paged cache's unit)."""
    return ds.parse_shapes(text, multiple_of=BLOCK_SLOTS)


# ==== child: one shape, both methods, in one process ===========================================

class ChildReport:
    """The child's JSON, rewritten (atomically) after every stage so a crash keeps what finished."""

    def __init__(self, path: str, base: dict):
        self.path = path
        self.data = dict(base)
        self.data.setdefault("entries", {})
        self.write()

    def stage(self, text: str) -> None:
        self.data["stage"] = text
        print(f"  stage: {text}", flush=True)
        self.write()

    def entry(self, method: str) -> dict:
        return self.data["entries"].setdefault(method, {"method": method, "us": None})

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


class Timer:
    """CUDA-event medians with the L2 flushed before each run (see the module doc)."""

    def __init__(self, device, reps: int, warmup: int, sleep_cycles: int):
        import torch
        self.flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.reps, self.warmup = reps, warmup
        self.sleep_cycles = sleep_cycles if hasattr(torch.cuda, "_sleep") else 0

    def median_us(self, launch: Callable[[], object]) -> Tuple[float, float]:
        """(median GPU time of launch() in us, median host time to enqueue it in us)."""
        import torch
        stream = torch.cuda.current_stream()
        for _ in range(self.warmup):
            launch()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        gpu, host = [], []
        for i in range(self.reps):
            self.flush_buffer.fill_(i & 0xFF)
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            start.record(stream)
            t0 = time.perf_counter()
            launch()
            host.append(time.perf_counter() - t0)
            stop.record(stream)
            stop.synchronize()
            gpu.append(start.elapsed_time(stop))
        return statistics.median(gpu) * 1e3, statistics.median(host) * 1e6


def copy_bandwidth_gbps(device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time), median of reps, GB/s."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


class Inputs:
    """One shape's key cache, tables, queries and weights (the module doc's inputs)."""

    def __init__(self, rows: int, slots: int, heads: int, head_dim: int, seed: int, device):
        import torch
        self.rows, self.slots, self.heads, self.head_dim = rows, slots, heads, head_dim
        g = torch.Generator(device=device)
        g.manual_seed(seed * 1000003 + rows * 7919 + slots)
        d = head_dim
        self.blocks_per_row = slots // BLOCK_SLOTS
        self.num_blocks = rows * self.blocks_per_row
        self.pool = torch.empty(self.num_blocks, BLOCK_SLOTS * (d + SCALE_BYTES), dtype=torch.uint8,
                                device=device)
        chunk = (1 << 20) // BLOCK_SLOTS  # blocks a chunk: a million keys, 512 MiB of fp32
        for b0 in range(0, self.num_blocks, chunk):
            b1 = min(self.num_blocks, b0 + chunk)
            keys = torch.randn((b1 - b0) * BLOCK_SLOTS, d, generator=g, device=device)
            scale = keys.abs().amax(dim=1).clamp(min=1e-4) / 448.0
            codes = (keys / scale[:, None]).to(torch.float8_e4m3fn)
            self.pool[b0:b1, :BLOCK_SLOTS * d] = codes.view(torch.uint8).view(b1 - b0, BLOCK_SLOTS * d)
            self.pool[b0:b1, BLOCK_SLOTS * d:] = scale.view(b1 - b0, BLOCK_SLOTS).view(torch.uint8)
            del keys, scale, codes
        perm = torch.randperm(self.num_blocks, generator=g, device=device)
        self.block_table = perm.to(torch.int32).view(rows, self.blocks_per_row).contiguous()
        query = torch.randn(rows, heads, d, generator=g, device=device)
        self.query_bf16 = query.to(torch.bfloat16).contiguous()
        self.query_fp8 = self.query_bf16.to(torch.float8_e4m3fn).view(rows, 1, heads, d).contiguous()
        self.weights = torch.randn(rows, heads, generator=g, device=device).contiguous()
        del query, perm
        torch.cuda.synchronize()

    @property
    def key_bytes(self) -> int:
        return self.rows * self.slots * (self.head_dim + SCALE_BYTES)

    def check_rows(self, n: int) -> List[int]:
        picks = [0, self.rows // 2, self.rows - 1, self.rows // 4, 3 * self.rows // 4]
        out: List[int] = []
        for r in picks:
            if r not in out and len(out) < n:
                out.append(r)
        return out

    def reference_row(self, row: int, query_row: "torch.Tensor") -> "torch.Tensor":
        """float64 [slots]: s_i * sum_h w_h * ReLU(q_h . code_i) over the row's blocks in order."""
        import torch
        d = self.head_dim
        q = query_row.to(torch.float64)                       # [H, D]
        w = self.weights[row].to(torch.float64)               # [H]
        table = self.block_table[row].long()
        parts = []
        step = 4096  # blocks a chunk: 256K slots
        for j0 in range(0, table.numel(), step):
            blocks = self.pool[table[j0:j0 + step]]           # [nb, 64 (D + 4)]
            codes = blocks[:, :BLOCK_SLOTS * d].contiguous().view(torch.float8_e4m3fn)
            codes = codes.reshape(-1, d).to(torch.float64)    # [nb * 64, D]
            scales = blocks[:, BLOCK_SLOTS * d:].contiguous().view(torch.float32).reshape(-1)
            parts.append(torch.relu(codes @ q.T) @ w * scales.to(torch.float64))
        return torch.cat(parts)


def rel_err(got: "torch.Tensor", ref: "torch.Tensor") -> float:
    import torch
    got = got.to(torch.float64)
    denom = ref.abs().max().item()
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - ref).abs().max().item() / max(denom, 1e-30)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:600]


def _poisoned() -> Optional[str]:
    """A sticky CUDA error after a failure, if any (then the child must stop)."""
    import torch
    try:
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - any error here means the context is gone
        return _reason(e)


def first_call(fn: Callable[[], object], what: str, refuse: Callable[[str], None]):
    """Calls fn once and waits for the GPU (its first call: a refusal shows here). Returns
    (True, its result); on an exception, refuse(reason) and (False, None), or BenchError naming
    `what` when the failure left a CUDA error, which poisons this process's context."""
    import torch
    try:
        out = fn()
        torch.cuda.synchronize()
        return True, out
    except Exception as e:  # noqa: BLE001 - the library refused the shape
        sticky = _poisoned()
        refuse(_reason(e))
        if sticky:
            raise BenchError(f"{what} left a CUDA error: {sticky}") from None
        return False, None


def run_dsa(inp: Inputs, args, timer: Timer, report: ChildReport, floor_us: float,
            outputs: Dict[str, "torch.Tensor"]) -> None:
    import torch
    entry = report.entry("dsa")
    entry["query"] = "bf16"
    report.stage("dsa: import")
    try:
        sys.path.insert(0, os.path.abspath(args.dsa_dir))
        import dsa_kernels as dk
    except Exception as e:  # noqa: BLE001 - not built, or a loader error: report it, go on
        entry["refused"] = f"dsa_kernels not importable from {args.dsa_dir}: {_reason(e)}"
        report.write()
        return
    rows, slots, bpr = inp.rows, inp.slots, inp.blocks_per_row
    dev = inp.pool.device
    first_row = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    block_offset = torch.arange(rows + 1, dtype=torch.int64, device=dev) * bpr
    logical = (torch.arange(rows * bpr, device=dev) % bpr).to(torch.int32)
    table_offset = torch.arange(rows, dtype=torch.int64, device=dev) * bpr
    tables = inp.block_table.reshape(-1).contiguous()
    num_slots = torch.full((rows,), slots, dtype=torch.int64, device=dev)
    position = torch.full((rows,), slots - 1, dtype=torch.int64, device=dev)
    score_offset = torch.arange(rows, dtype=torch.int64, device=dev) * slots
    scores = torch.empty(rows * slots, dtype=torch.float32, device=dev)

    def launch():
        kind, message = dk._C.scan_into(inp.pool, first_row, block_offset, rows * bpr, logical,
                                        table_offset, tables, num_slots, inp.query_bf16,
                                        inp.weights, position, score_offset, scores,
                                        args.dsa_kernel, "auto")
        if kind != 0:
            raise (ValueError if kind == 1 else RuntimeError)(message)

    def refuse(reason: str) -> None:
        entry["refused"] = reason
        report.write()

    report.stage("dsa: first call")
    if not first_call(launch, "dsa", refuse)[0]:
        return
    report.stage("dsa: check")
    out = scores.view(rows, slots)
    rows_checked = inp.check_rows(args.check_rows)
    entry["checked_rows"] = rows_checked
    entry["max_rel_err"] = max(rel_err(out[r], inp.reference_row(r, inp.query_bf16[r]))
                               for r in rows_checked)
    outputs["dsa"] = out[rows_checked].clone()
    report.stage("dsa: timing")
    entry["us"], entry["host_us"] = (round(x, 2) for x in timer.median_us(launch))
    entry["pct_of_floor"] = round(100.0 * floor_us / entry["us"], 1)
    report.write()


def deepgemm_refusal(inp: Inputs, cc: Tuple[int, int]) -> Optional[str]:
    """What DeepGEMM's host asserts would refuse (checked here: its C++ exceptions may crash)."""
    if cc[0] not in (9, 10):
        return f"sm_{cc[0]}{cc[1]}: DeepGEMM's paged MQA logits run on sm_90 and sm_100 only"
    heads_ok = (32, 64) if cc[0] == 9 else (8, 16, 32, 64)
    if inp.heads not in heads_ok:
        return f"heads {inp.heads} not in {heads_ok} (DeepGEMM on sm_{cc[0]}x)"
    if inp.head_dim not in (32, 64, 128):
        return f"head_dim {inp.head_dim} not in (32, 64, 128)"
    return None


def run_deepgemm(inp: Inputs, args, timer: Timer, report: ChildReport, floor_us: float,
                 outputs: Dict[str, "torch.Tensor"]) -> None:
    import torch
    entry = report.entry("deepgemm")
    meta_entry = report.entry("deepgemm_metadata")
    entry["query"] = "fp8_e4m3"
    meta_entry["query"] = None

    def refuse(reason: str) -> None:
        entry["refused"] = reason
        if meta_entry.get("us") is None and "refused" not in meta_entry:
            meta_entry["refused"] = reason
        report.write()

    if not args.deepgemm_dir:
        return refuse("no --deepgemm-dir")
    report.stage("deepgemm: import and runtime init")
    try:
        sys.path.insert(0, os.path.abspath(args.deepgemm_dir))
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - not built, or a loader error
        return refuse(f"deep_gemm not importable from {args.deepgemm_dir}: {_reason(e)}")
    report.data["deepgemm"] = {
        "version": getattr(deep_gemm, "__version__", None),
        "commit": args.deepgemm_commit,
        "file": getattr(deep_gemm, "__file__", None),
        "num_sms": int(deep_gemm.get_num_sms()),
        "pdl": bool(deep_gemm.get_pdl()) if hasattr(deep_gemm, "get_pdl") else None,
        "jit_cache": os.environ.get("DG_JIT_CACHE_DIR"),
    }
    cc = torch.cuda.get_device_capability()
    why = deepgemm_refusal(inp, cc)
    if why:
        return refuse(why)
    rows, slots, d = inp.rows, inp.slots, inp.head_dim
    dev = inp.pool.device
    kv_cache = inp.pool.view(inp.num_blocks, BLOCK_SLOTS, 1, d + SCALE_BYTES)
    context_lens = torch.full((rows, 1), slots, dtype=torch.int32, device=dev)
    num_sms = int(deep_gemm.get_num_sms())

    def metadata():
        return deep_gemm.get_paged_mqa_logits_metadata(context_lens, BLOCK_SLOTS, num_sms)

    report.stage("deepgemm: metadata, first call (JIT)")
    ran, schedule = first_call(metadata, "deepgemm metadata",
                               lambda r: refuse(f"get_paged_mqa_logits_metadata: {r}"))
    if not ran:
        return
    report.stage("deepgemm: metadata timing")
    meta_entry["us"], meta_entry["host_us"] = (round(x, 2) for x in timer.median_us(metadata))
    meta_entry["schedule_shape"] = list(schedule.shape)
    report.write()

    def launch():
        return deep_gemm.fp8_paged_mqa_logits(
            q=inp.query_fp8, kv_cache=kv_cache, weights=inp.weights, context_lens=context_lens,
            block_table=inp.block_table, schedule_meta=schedule, max_context_len=slots,
            clean_logits=False)

    report.stage("deepgemm: logits, first call (JIT)")
    ran, logits = first_call(launch, "deepgemm logits",
                             lambda r: refuse(f"fp8_paged_mqa_logits: {r}"))
    if not ran:
        return
    report.stage("deepgemm: check")
    entry["logits_shape"] = list(logits.shape)
    rows_checked = inp.check_rows(args.check_rows)
    entry["checked_rows"] = rows_checked
    q_fp8 = inp.query_fp8.view(rows, inp.heads, d)
    entry["max_rel_err"] = max(rel_err(logits[r], inp.reference_row(r, q_fp8[r]))
                               for r in rows_checked)
    if "dsa" in outputs:
        ours = outputs["dsa"].to(torch.float64)
        theirs = logits[rows_checked].to(torch.float64)
        entry["vs_dsa_max_rel_diff"] = (theirs - ours).abs().max().item() / max(
            ours.abs().max().item(), 1e-30)
    del logits
    report.stage("deepgemm: timing")
    entry["us"], entry["host_us"] = (round(x, 2) for x in timer.median_us(launch))
    entry["pct_of_floor"] = round(100.0 * floor_us / entry["us"], 1)
    report.write()


def _unbuffer_c_stdout() -> None:
    """Makes C stdio's stdout unbuffered (glibc), so what an extension printf()s before a crash
    (DeepGEMM prints the nvcc log, then throws) reaches the parent instead of dying in a buffer."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 2, 0)  # 2: _IONBF
    except Exception:  # noqa: BLE001 - not glibc: keep the default buffering
        pass


def child_main(args) -> int:
    import faulthandler
    faulthandler.enable()  # a segfault prints the Python stack to stderr (the parent keeps it)
    _unbuffer_c_stdout()
    (shape, rows, slots), = parse_shapes(args.single)
    report = ChildReport(args.child_out, {"shape": shape, "rows": rows, "slots": slots,
                                          "stage": "start"})
    torch = ds.cuda_torch()
    device = torch.device("cuda", torch.cuda.current_device())
    prop = torch.cuda.get_device_properties(device)
    report.data.update({"device": prop.name, "sms": prop.multi_processor_count,
                        "torch": torch.__version__, "cuda": torch.version.cuda})
    report.stage("copy bandwidth")
    bandwidth = copy_bandwidth_gbps(device)
    floor_us = rows * slots * (args.head_dim + SCALE_BYTES) / (bandwidth * 1e9) * 1e6
    report.data.update({"copy_GBps": round(bandwidth, 1), "key_bytes":
                        rows * slots * (args.head_dim + SCALE_BYTES), "floor_us": round(floor_us, 2)})
    report.stage("inputs")
    inp = Inputs(rows, slots, args.heads, args.head_dim, args.seed, device)
    timer = Timer(device, args.reps, args.warmup, args.sleep_cycles)
    outputs: Dict[str, "torch.Tensor"] = {}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "dsa" in methods:
        run_dsa(inp, args, timer, report, floor_us, outputs)
    if "deepgemm" in methods:
        run_deepgemm(inp, args, timer, report, floor_us, outputs)
    report.stage("done")
    # Leave without running static destructors: DeepGEMM's runtime frees its cuBLASLt handle in
    # one that may throw once CUDA is unloading, which would turn a finished run into an abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ==== parent: one child a shape, then the table ================================================

def child_command(args, shape: str, out_path: str, methods: str, reps: int,
                  warmup: int) -> List[str]:
    """This script with --single SHAPE and the run's options."""
    cmd = [sys.executable, os.path.abspath(__file__), "--single", shape, "--child-out", out_path,
           "--methods", methods, "--heads", str(args.heads), "--head-dim", str(args.head_dim),
           "--reps", str(reps), "--warmup", str(warmup),
           "--check-rows", str(args.check_rows), "--seed", str(args.seed),
           "--sleep-cycles", str(args.sleep_cycles), "--dsa-dir", args.dsa_dir,
           "--dsa-kernel", args.dsa_kernel]
    if args.deepgemm_dir:
        cmd += ["--deepgemm-dir", args.deepgemm_dir]
    if args.deepgemm_commit:
        cmd += ["--deepgemm-commit", args.deepgemm_commit]
    return cmd


def run_echoed(cmd: List[str], timeout_s: float) -> Tuple[int, List[str], bool]:
    """Runs cmd in its own process group, echoing its output; (exit code, last lines, timed out).
    At the time limit the whole group (the child and, say, the nvcc it started) is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True)
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    watchdog = threading.Timer(timeout_s, kill)
    watchdog.start()
    tail: deque = deque(maxlen=60)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            print(f"    | {line}", flush=True)
        rc = proc.wait()
    finally:
        watchdog.cancel()
    return rc, list(tail), timed_out.is_set()


def gdb_backtrace(args, shape: str, out_path: str, timeout_s: float) -> str:
    """After a crash in DeepGEMM: reruns that shape's DeepGEMM part (3 runs) under gdb, if the
    host has it, for a native backtrace; its timings are not used. Returns the frames, one line."""
    gdb = shutil.which("gdb")
    if not gdb:
        return "no gdb on this host for a native backtrace"
    print(f"    rerunning {shape} (deepgemm only) under gdb for a native backtrace", flush=True)
    cmd = [gdb, "-batch", "-nx", "-ex", "set pagination off", "-ex", "set startup-with-shell off",
           "-ex", "run", "-ex", "bt 30", "--args"]
    cmd += child_command(args, shape, out_path, "deepgemm", reps=3, warmup=1)
    rc, tail, timed_out = run_echoed(cmd, timeout_s)
    if os.path.exists(out_path):
        os.remove(out_path)
    frames = [x.strip() for x in tail if x.lstrip().startswith("#")]
    signal_lines = [x.strip() for x in tail if "received signal" in x]
    if not frames:
        return ("gdb rerun: " + _exit_text(rc, timed_out, timeout_s) + ", no frames"
                + (f" ({signal_lines[-1]})" if signal_lines else ""))
    return "native backtrace (gdb rerun): " + " | ".join(signal_lines[-1:] + frames[:20])


def _last_words(tail: List[str]) -> List[str]:
    """The end of a child's output that says why it stopped: from the last Python fatal error or
    traceback on (faulthandler's stack included), else the last 8 non-empty lines."""
    lines = [x for x in tail if x.strip() and not x.startswith("Extension modules:")]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(("Fatal Python error", "Traceback")):
            return lines[i:i + 12]
    return lines[-8:]


def _exit_text(rc: int, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"child killed after its {timeout_s:.0f} s limit"
    if rc < 0:
        try:
            return f"child died of {signal.Signals(-rc).name}"
        except ValueError:
            return f"child died of signal {-rc}"
    return f"child exited with code {rc}"


def parent_main(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise BenchError(f"--methods: unknown {unknown}; known: {ALL_METHODS}")
    args.methods = ",".join(m for m in ALL_METHODS if m in methods)  # ours first: the cross check
    expected = [m for m in ALL_METHODS if m in methods]
    if "deepgemm" in expected:
        expected.append("deepgemm_metadata")
    shapes = parse_shapes(args.shapes)
    t0 = time.monotonic()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    results: List[dict] = []
    shape_info: List[dict] = []
    env: dict = {}
    gdb_tried = False
    for shape, rows, slots in shapes:
        elapsed = time.monotonic() - t0
        left = args.time_budget_s - elapsed if args.time_budget_s > 0 else float("inf")
        print(f"[{elapsed:7.1f} s] shape {shape}", flush=True)
        child_out = os.path.join(out_dir, f".deepgemm_bench_{shape}.json")
        if os.path.exists(child_out):
            os.remove(child_out)
        if left < 20:
            rc, tail, timed_out, why = 0, [], False, "skipped: --time-budget-s spent"
        else:
            timeout_s = min(args.child_timeout_s, left)
            cmd = child_command(args, shape, child_out, args.methods, args.reps, args.warmup)
            rc, tail, timed_out = run_echoed(cmd, timeout_s)
            why = _exit_text(rc, timed_out, timeout_s)
        data: dict = {}
        if os.path.exists(child_out):
            with open(child_out, encoding="utf-8") as f:
                data = json.load(f)
            os.remove(child_out)
        stage = str(data.get("stage", ""))
        backtrace = None
        if (rc < 0 and not timed_out and stage.startswith("deepgemm") and not gdb_tried
                and args.gdb_on_crash):
            gdb_tried = True
            left = args.time_budget_s - (time.monotonic() - t0) if args.time_budget_s > 0 else 600
            if left > 60:
                backtrace = gdb_backtrace(args, shape, child_out, min(150.0, left - 30))
            else:
                backtrace = "no time left for a gdb rerun"
        for key in ("device", "sms", "torch", "cuda", "deepgemm"):
            if key in data and key not in env:
                env[key] = data[key]
        shape_info.append(dict({k: data.get(k) for k in ("copy_GBps", "key_bytes", "floor_us")},
                               shape=shape, rows=rows, slots=slots, child=why))
        failed_stage = stage if (rc != 0 or timed_out) and stage != "done" else None
        for method in expected:
            e = dict(data.get("entries", {}).get(method, {"method": method, "us": None}))
            e.update({"shape": shape, "rows": rows, "slots": slots,
                      "floor_us": data.get("floor_us")})
            if e.get("us") is None and "refused" not in e:
                if rc == 0 and not timed_out and not why.startswith("skipped"):
                    e["refused"] = "not run"
                else:
                    last = " | ".join(_last_words(tail))
                    e["refused"] = (f"{why}" + (f" at stage '{failed_stage}'" if failed_stage else "")
                                    + (f"; last output: {last}" if last else ""))[:1500]
                    if backtrace and method.startswith("deepgemm"):
                        e["backtrace"] = backtrace[:3000]
            results.append(e)
        print(f"[{time.monotonic() - t0:7.1f} s] shape {shape}: {why}", flush=True)

    report = {
        "source": "bench/peers/deepgemm_bench.py",
        "device": env.get("device"),
        "sms": env.get("sms"),
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "deepgemm": env.get("deepgemm") or {"commit": args.deepgemm_commit,
                                             "dir": args.deepgemm_dir},
        "heads": args.heads,
        "head_dim": args.head_dim,
        "queries": "dsa: bf16; deepgemm: fp8 e4m3 (the same bf16 query cast, no scale); same keys, "
                   "block tables and head weights",
        "timing": f"median of {args.reps} after {args.warmup} warm-ups, CUDA events, 256 MiB "
                  f"written and a {args.sleep_cycles}-cycle GPU sleep before each run (outside the "
                  "events); host_us: median host time to enqueue the call",
        "floor": "rows * slots * (head_dim + 4) bytes / copy_GBps (torch device copy, read + write "
                 "bytes, same process); pct_of_floor = 100 * floor_us / us",
        "check": "max_rel_err: max |out - ref| / max |ref| on checked_rows, ref in float64 with the "
                 "method's own query precision",
        "methods": {m: METHOD_DOCS[m] for m in expected},
        "shapes": shape_info,
        "results": results,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print_table(report)
    print(f"wrote {args.out}")
    return 0


def print_table(report: dict) -> None:
    by = {(r["shape"], r["method"]): r for r in report["results"]}
    dg = report.get("deepgemm") or {}
    print(f"\n{report.get('device')}, {report.get('sms')} SMs, torch {report.get('torch')}; "
          f"DeepGEMM {dg.get('version')} {dg.get('commit') or ''}; H {report['heads']}, "
          f"D {report['head_dim']}")
    print("queries: " + report["queries"])
    print(f"{'shape':<11} {'GB/s':>6} {'floor':>8} {'dsa us':>8} {'%floor':>6} {'dg us':>8} "
          f"{'%floor':>6} {'dg/dsa':>6} {'meta us':>7} {'err dsa':>8} {'err dg':>8} {'dg~dsa':>8}")

    def num(v, fmt):
        width = int(fmt.split(".")[0])
        return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)

    for s in report["shapes"]:
        shape = s["shape"]
        ours = by.get((shape, "dsa"), {})
        theirs = by.get((shape, "deepgemm"), {})
        meta = by.get((shape, "deepgemm_metadata"), {})
        ratio = (theirs["us"] / ours["us"] if isinstance(theirs.get("us"), float)
                 and isinstance(ours.get("us"), float) else None)
        print(f"{shape:<11} {num(s.get('copy_GBps'), '6.0f')} {num(s.get('floor_us'), '8.1f')} "
              f"{num(ours.get('us'), '8.1f')} {num(ours.get('pct_of_floor'), '6.1f')} "
              f"{num(theirs.get('us'), '8.1f')} {num(theirs.get('pct_of_floor'), '6.1f')} "
              f"{num(ratio, '6.2f')} {num(meta.get('us'), '7.1f')} "
              f"{num(ours.get('max_rel_err'), '8.1e')} {num(theirs.get('max_rel_err'), '8.1e')} "
              f"{num(theirs.get('vs_dsa_max_rel_diff'), '8.1e')}")
    for r in report["results"]:
        if r.get("refused"):
            print(f"  {r['shape']} {r['method']}: {r['refused'][:400]}")
        if r.get("backtrace"):
            print(f"    {r['backtrace'][:600]}")
    print("us: medians; %floor = 100 * floor / us; dg/dsa > 1: ours faster; err: max rel. error "
          "vs a float64 reference of the method's own query; dg~dsa: DeepGEMM vs ours (fp8 vs bf16 "
          "queries, info only)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the JSON to write (required unless --single)")
    parser.add_argument("--deepgemm-dir", default=None,
                        help="a DeepGEMM tree whose deep_gemm package is built in place")
    parser.add_argument("--dsa-dir", default=os.path.join(REPO, "python"),
                        help="python/ of this repo, built in place (default: %(default)s)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxSLOTS,... (default: %(default)s)")
    parser.add_argument("--methods", default=",".join(ALL_METHODS),
                        help="comma list of %s (default: all)" % ", ".join(ALL_METHODS))
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=3, help="rows checked against the reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sleep-cycles", type=int, default=500000,
                        help="GPU sleep before each timed run, after the L2 flush (0: none)")
    parser.add_argument("--dsa-kernel", default="tensor_cores", choices=["tensor_cores", "cuda_cores"])
    parser.add_argument("--deepgemm-commit", default=None, help="recorded in the JSON")
    parser.add_argument("--child-timeout-s", type=float, default=240.0,
                        help="limit of one shape's child process (first one JIT-compiles)")
    parser.add_argument("--time-budget-s", type=float, default=0.0,
                        help="stop starting shapes once this much time has passed (0: no limit)")
    parser.add_argument("--no-gdb", dest="gdb_on_crash", action="store_false",
                        help="after DeepGEMM crashes a child, do not rerun it under gdb (if the "
                             "host has gdb) for a native backtrace (default: one such rerun)")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.check_rows < 1:
        parser.error("--reps and --check-rows must be >= 1, --warmup >= 0")
    if args.heads < 1 or args.head_dim < 1:
        parser.error("--heads and --head-dim must be >= 1")
    try:
        if args.single:
            if not args.child_out:
                parser.error("--single needs --child-out")
            return child_main(args)
        if not args.out:
            parser.error("--out is required")
        return parent_main(args)
    except BenchError as e:
        print(f"deepgemm_bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
