#!/usr/bin/env python3
"""Times the top-K kernels that vLLM and SGLang (sgl-kernel, JIT) run for DeepSeek V3.2's
sparse-attention indexer beside our top-K (dsa_kernels, python/), each peer group in a child
process with ours timed in it too, on the scores bench_topk_peers uses, and writes JSON in bench_topk_peers' schema so
bench/peers/report.py --extra merges it into the same table. The pattern (scores, timing,
checks, JSON) is deepselect_bench.py's, whose helpers this script imports.

The peers are not part of this repo: their sources (each with its license and our small binding,
see bench/peers/frameworks/README.md; bench/peers/fetch_frameworks.sh assembles them, by default
into build/peers/frameworks) sit in a folder given by --peers-dir, and each peer group is compiled
there with torch.utils.cpp_extension.load (sm_90a), its build under --build-dir:
  - group `vllm` (vLLM's csrc: sampler.cu, topk.cu, cooperative_topk.cu, registered as
    torch.ops.vllm_peer.* with vLLM's own schemas), methods
      `vllm_cooperative`  cooperative_topk: what vLLM's SparseIndexerTopk picks ("auto") on SM90
                          for <= 64 rows, K 512/1024/2048;
      `vllm_persistent`   persistent_topk: its pick above 64 rows (and "persistent");
      `vllm_per_row`      top_k_per_row_decode: the "per_row" fallback, next_n 1;
      `vllm_prefill`      top_k_per_row_prefill (the prefill path), rowStarts 0, rowEnds slots;
    each called as SparseIndexerTopk.forward calls it (lengths = int32 [rows] = the row's slot
    count, workspace 1 MiB uint8, max_seq_len = the longest row, output int32 [rows, K]);
  - group `sgl` (sgl-kernel's csrc/elementwise/topk.cu through a pybind11 module), methods
      `sgl_fast_topk_v2`  fast_topk (sgl_kernel.fast_topk_v2: DSATopKBackend.topk_func, the
                          unfused path), lengths = the row's slot count, no row_starts;
      `sgl_transform`     fast_topk_transform_fused in its decode form (one query row a request,
                          no row_starts: topk_transform_decode_kernel) over an identity
                          page_size-1 page table, so its output is the selected slots; the
                          gather through the table is part of its time, as in SGLang;
  - group `sglang` (SGLang's JIT top-k v2, csrc/deepseek_v4/topk_v2.cuh from the sglang package,
    its tvm-ffi host code called through a pybind11 module; first SGLang's occupancy probe, whose
    cluster counts it is compiled with, as SGLang does), method
      `sglang_topk_v2`    topk_transform_paged_v2: what SGLang's DSA backend runs for decode by
                          default (SGLANG_OPT_USE_TOPK_V2, SGLANG_DSA_FUSE_TOPK, PAGED), over
                          an identity page table of page_size 64 (real_page_table), with the
                          plan (plan_topk_v2) built once outside the timing, as once a forward.
Scores, timing and checks are deepselect_bench.py's: FillBellScores of the flat index (or every
score 1.0 with --scores equal), fp32 [rows, slots]; CUDA events around each launch on the current
stream, 256 MiB written before each timed run, 5 warm-ups, median of 30 (us); `rows_top_k` counts
rows whose K slots are distinct, in range and whose scores equal torch.topk's K values as a
multiset; `rows_same_set` counts rows whose slot set equals ours (dsa). A peer that refuses a shape
(an exception from its binding) gets "us": null and the reason in "refused".

Isolation: each peer group runs in a child process of its own (this script with --child), which
loads dsa_kernels and the group, and times ours (`dsa`) and the group's methods shape by shape,
reporting each result as a JSON line as soon as it has it. A child that dies (a segfault, an
illegal address, which poisons its CUDA context) or stops reporting for --stall-s seconds is
ended; the method it was in gets a null with the reason, and a new child goes on from the next
shape (a method that stalled is not run again). The `dsa` rows are those of the first child that
timed each shape; every peer row also carries "dsa_us_same_process", ours timed in its child.

usage: python3 bench/peers/topk_frameworks_bench.py --peers-dir build/peers/frameworks --out r.json
           [--build-dir /tmp/topk_peers_build] [--shapes 1x16384,...] [--scores bell|equal]
           [--k 2048] [--methods vllm_cooperative,...] [--reps 30] [--warmup 5]
           [--stall-s 60] [--budget-s 0] [--build-only]
bench/peers/frameworks/topk_peers.sh runs it on the GPU host (builds, then bell and all-equal
scores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import deepselect_bench as ds  # noqa: E402  (torch is imported lazily there too)

DEFAULT_SHAPES = ds.DEFAULT_SHAPES

# method -> (group, description); ours first (the same-set reference)
METHOD_DOCS = {
    "dsa": ("dsa", "ours (dsa_kernels.topk over the same fp32 scores): best first, ties to the "
                   "lower slot"),
    "vllm_cooperative": ("vllm", "vLLM cooperative_topk (its 'auto' pick on SM90 for <= 64 rows): "
                                 "lengths = the row's slots, 1 MiB workspace, unsorted int32"),
    "vllm_persistent": ("vllm", "vLLM persistent_topk (its 'auto' pick above 64 rows): lengths = "
                                "the row's slots, 1 MiB workspace, max_seq_len = slots"),
    "vllm_per_row": ("vllm", "vLLM top_k_per_row_decode (its 'per_row' fallback), next_n 1, "
                             "seq_lens = the row's slots"),
    "vllm_prefill": ("vllm", "vLLM top_k_per_row_prefill (its prefill top-K), rowStarts 0, "
                             "rowEnds = the row's slots"),
    "sgl_fast_topk_v2": ("sgl", "sgl-kernel fast_topk (sgl_kernel.fast_topk_v2, SGLang's unfused "
                                "DSA top-K), lengths = the row's slots, unsorted int32"),
    "sgl_transform": ("sgl", "sgl-kernel fast_topk_transform_fused, decode form (no row_starts, "
                             "one row a request), identity page_size-1 table: its output is the "
                             "slots; the table gather is timed with it"),
    "sglang_topk_v2": ("sglang", "SGLang top-k v2 (JIT, topk_transform_paged_v2: its default DSA "
                                 "decode top-K), identity page_size-64 table, plan built once "
                                 "outside the timing as per forward"),
}
ALL_METHODS = list(METHOD_DOCS)
GROUPS = ["vllm", "sgl", "sglang"]
WORKSPACE_BYTES = 1024 * 1024  # vLLM's RADIX_TOPK_WORKSPACE_SIZE

BenchError = ds.BenchError


# ---- building and loading the peers --------------------------------------------------------

_UNDO_TORCH_HALF_FLAGS = ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                          "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def _group_spec(group: str, peers_dir: str) -> dict:
    peers_dir = os.path.abspath(peers_dir)
    if group == "vllm":
        root = os.path.join(peers_dir, "vllm")
        # vLLM's _C_stable_libtorch definitions (CMakeLists.txt): the stable ABI of torch 2.11,
        # USE_CUDA for the C shim's CUDA calls, the cooperative top-K on (sm_90a is one of its
        # archs), ENABLE_FP8; and it drops torch's -D__CUDA_NO_HALF*__ flags, as here.
        defines = ["-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL",
                   "-DVLLM_ENABLE_COOPERATIVE_TOPK=1", "-DENABLE_FP8"]
        return {
            "name": "vllm_peer",
            "sources": [os.path.join(root, "bind.cpp")] +
                       [os.path.join(root, "csrc", f) for f in
                        ("sampler.cu", "topk.cu", "cooperative_topk.cu")],
            "include": [root, os.path.join(root, "csrc")],
            "cflags": ["-O3"] + defines,
            "cuda_cflags": ["-O3", _GENCODE] + defines + _UNDO_TORCH_HALF_FLAGS,
            "python_module": False,
        }
    if group == "sgl":
        root = os.path.join(peers_dir, "sgl_kernel")
        return {
            "name": "sgl_kernel_peer",
            "sources": [os.path.join(root, "bind.cpp"), os.path.join(root, "topk.cu")],
            "include": [root],
            "cflags": ["-O3"],
            "cuda_cflags": ["-O3", _GENCODE],
            "python_module": True,
        }
    if group in ("sglang", "sglang_probe"):
        root = os.path.join(peers_dir, "sglang_jit")
        lib = os.path.join(root, "tvm_ffi", "lib")
        # SGLang's load_jit flags (get_default_target_flags, DEFAULT_CFLAGS) for an sm_90 device;
        # the -U flags drop torch's -D__CUDA_NO_HALF*__, which tvm-ffi's build does not add.
        sources = (["probe_bind.cpp", "probe_entry.cu"] if group == "sglang_probe"
                   else ["bind.cpp", "entry.cu"])
        return {
            "name": "sglang_jit_probe" if group == "sglang_probe" else "sglang_jit_peer",
            "sources": [os.path.join(root, f) for f in sources],
            "include": [root, os.path.join(root, "include"),
                        os.path.join(root, "tvm_ffi", "include")],
            "cflags": ["-O3"],
            "cuda_cflags": [_GENCODE, "-DSGL_CUDA_ARCH=900", "-std=c++20", "-O3",
                            "--expt-relaxed-constexpr"] + _UNDO_TORCH_HALF_FLAGS,
            "ldflags": [f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"],
            "python_module": True,
        }
    raise BenchError(f"unknown peer group {group}")


def _load_spec(spec: dict, group: str, build_dir: str, verbose: bool, extra_cuda=()):
    from torch.utils.cpp_extension import load
    missing = [s for s in spec["sources"] if not os.path.isfile(s)]
    if missing:
        raise BenchError(f"{group}: sources missing: {missing}")
    out = os.path.join(os.path.abspath(build_dir), spec["name"])
    os.makedirs(out, exist_ok=True)
    return load(name=spec["name"], sources=spec["sources"],
                extra_include_paths=spec["include"], extra_cflags=spec["cflags"],
                extra_cuda_cflags=spec["cuda_cflags"] + list(extra_cuda),
                extra_ldflags=spec.get("ldflags", []), build_directory=out,
                is_python_module=spec["python_module"], verbose=verbose)


# What the SGLang group was compiled with (its occupancy probe's answers), for the JSON.
SGLANG_PROBE: Dict[str, object] = {}


def load_group(group: str, peers_dir: str, build_dir: str, verbose: bool = False):
    """Compiles (or finds up to date) and loads one peer group; returns its handle."""
    if group == "sglang":
        # As sglang's _jit_topk_v2_module: probe how many 8-block clusters (2 blocks an SM) and
        # 16-block clusters (1 an SM) fit, 0 where none does, and compile top-k v2 with them.
        probe = _load_spec(_group_spec("sglang_probe", peers_dir), group, build_dir, verbose)
        flags = []
        for cluster_size, occupancy in ((8, 2), (16, 1)):
            macro = f"SGL_TOPK_V2_MAX_C{cluster_size}_OCC{occupancy}"
            try:
                value = int(probe.get_max_active_clusters(cluster_size, occupancy))
            except Exception as e:  # sglang lets this propagate; here the header default stands
                SGLANG_PROBE[macro] = f"probe failed ({e}); header default"
                continue
            SGLANG_PROBE[macro] = value
            flags.append(f"-D{macro}={value}")
        module = _load_spec(_group_spec(group, peers_dir), group, build_dir, verbose, flags)
        SGLANG_PROBE["build_info"] = module.build_info()
        return module
    module = _load_spec(_group_spec(group, peers_dir), group, build_dir, verbose)
    if group == "vllm":
        import torch
        return torch.ops.vllm_peer
    return module


# ---- the peers' methods ---------------------------------------------------------------------

def peer_methods(group: str, handle, scores, k: int) -> Dict[str, "ds.Method"]:
    import torch
    rows, slots = scores.shape
    device = scores.device
    state: Dict[str, dict] = {}

    def lengths():
        return torch.full((rows,), slots, dtype=torch.int32, device=device)

    methods: Dict[str, ds.Method] = {}
    if group == "vllm":
        def make_ws(name: str, op_name: str) -> ds.Method:
            def prepare():
                op = getattr(handle, op_name)  # AttributeError when not compiled in: refused
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                lens = lengths()
                ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                state[name] = {"out": out}

                def launch():
                    op(scores, lens, out, ws, k, slots)
                return launch
            return ds.Method(name, prepare, lambda: state[name]["out"], "fp32")

        def per_row() -> ds.Method:
            def prepare():
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                seq_lens = lengths()
                state["vllm_per_row"] = {"out": out}
                op = handle.top_k_per_row_decode

                def launch():
                    op(scores, 1, seq_lens, out, rows, scores.stride(0), scores.stride(1), k)
                return launch
            return ds.Method("vllm_per_row", prepare, lambda: state["vllm_per_row"]["out"],
                             "fp32")

        def prefill() -> ds.Method:
            def prepare():
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                starts = torch.zeros(rows, dtype=torch.int32, device=device)
                ends = lengths()
                state["vllm_prefill"] = {"out": out}
                op = handle.top_k_per_row_prefill

                def launch():
                    op(scores, starts, ends, out, rows, scores.stride(0), scores.stride(1), k)
                return launch
            return ds.Method("vllm_prefill", prepare, lambda: state["vllm_prefill"]["out"],
                             "fp32")

        methods["vllm_cooperative"] = make_ws("vllm_cooperative", "cooperative_topk")
        methods["vllm_persistent"] = make_ws("vllm_persistent", "persistent_topk")
        methods["vllm_per_row"] = per_row()
        methods["vllm_prefill"] = prefill()
    elif group == "sgl":
        def fast_topk() -> ds.Method:
            def prepare():
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                lens = lengths()
                state["sgl_fast_topk_v2"] = {"out": out}

                def launch():
                    handle.fast_topk(scores, out, lens, None)
                return launch
            return ds.Method("sgl_fast_topk_v2", prepare,
                             lambda: state["sgl_fast_topk_v2"]["out"], "fp32")

        def transform() -> ds.Method:
            def prepare():
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                lens = lengths()
                # page_table_1 [requests, slots]: token t of request r at KV slot t (identity),
                # cu_seqlens_q = 0..rows (one query row a request): the decode kernel.
                table = torch.arange(slots, dtype=torch.int32, device=device).expand(rows, slots)
                table = table.contiguous()
                cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
                state["sgl_transform"] = {"out": out, "table": table}

                def launch():
                    handle.fast_topk_transform_fused(scores, lens, out, table, cu_seqlens_q, None)
                return launch
            return ds.Method("sgl_transform", prepare, lambda: state["sgl_transform"]["out"],
                             "fp32")

        methods["sgl_fast_topk_v2"] = fast_topk()
        methods["sgl_transform"] = transform()
    elif group == "sglang":
        def topk_v2() -> ds.Method:
            page_size = 64

            def prepare():
                out = torch.empty(rows, k, dtype=torch.int32, device=device)
                seq_lens = lengths()
                # real_page_table [rows, pages]: page p of every row holds slots p*64..p*64+63
                pages = (slots + page_size - 1) // page_size
                table = torch.arange(pages, dtype=torch.int32, device=device).expand(rows, pages)
                table = table.contiguous()
                # plan_topk_v2(seq_lens): new_empty(B + 1, 2), then the plan kernel (which
                # writes it only where the persistent cluster pool applies)
                plan = torch.empty(rows + 1, 2, dtype=torch.int32, device=device)
                handle.topk_plan(seq_lens, plan, -1)
                state["sglang_topk_v2"] = {"out": out, "table": table, "plan": plan}

                def launch():
                    handle.topk_transform_paged(scores, seq_lens, table, out, page_size, plan)
                return launch
            return ds.Method("sglang_topk_v2", prepare, lambda: state["sglang_topk_v2"]["out"],
                             "fp32")

        methods["sglang_topk_v2"] = topk_v2()
    return methods


# ---- the child: one group, shape by shape ---------------------------------------------------

class Events:
    """JSON lines to the parent, each flushed as written."""

    def __init__(self, path: str):
        self.f = open(path, "a", encoding="utf-8")

    def put(self, **event) -> None:
        self.f.write(json.dumps(event) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def run_child(args) -> int:
    torch = ds.cuda_torch()
    events = Events(args.events)
    group = args.child
    methods = [m for m in args.methods.split(",") if m in METHOD_DOCS and m != "dsa"
               and METHOD_DOCS[m][0] == group]
    device = torch.device("cuda", torch.cuda.current_device())
    prop = torch.cuda.get_device_properties(device)
    events.put(event="device", name=prop.name, sms=prop.multi_processor_count,
               torch=torch.__version__)

    dk, ours_error = None, None
    try:
        import dsa_kernels as dk  # noqa: F811 - python/ built with setup.py build_ext --inplace
    except ImportError as e:
        ours_error = f"dsa_kernels not importable ({e}); build python/ and put it on PYTHONPATH"
        print(f"warning: {ours_error}", file=sys.stderr)

    handle, group_error = None, None
    t0 = time.time()
    try:
        handle = load_group(group, args.peers_dir, args.build_dir)
    except Exception as e:  # a compiler or loader failure: report it, keep ours
        group_error = f"{group} failed to build or load: {type(e).__name__}: {str(e)[-600:]}"
        print(group_error, file=sys.stderr)
    events.put(event="loaded", group=group, seconds=round(time.time() - t0, 1),
               error=group_error, build=dict(SGLANG_PROBE) if group == "sglang" else None)

    if args.scores == "bell":
        ds.check_bell_scores(device)
    flush = ds.L2Flush(device)
    k = args.k
    for shape, rows, slots in ds.parse_shapes(args.shapes):
        if args.scores == "bell":
            scores = ds.bell_scores(rows, slots, device)
        else:
            scores = torch.ones(rows, slots, dtype=torch.float32, device=device)
        table: Dict[str, ds.Method] = {}
        if dk is not None:
            table["dsa"] = ds.ours_method(dk, scores, k)
        if handle is not None:
            table.update(peer_methods(group, handle, scores, k))
        reference, reference_name = None, None
        ours_us = None
        for name in ["dsa"] + methods:
            entry = {"shape": shape, "rows": rows, "slots": slots, "method": name, "us": None,
                     "rows_same_set": None, "rows_top_k": None}
            method = table.get(name)
            if method is None:
                entry["refused"] = ours_error if name == "dsa" else (group_error or "not built")
                events.put(event="result", entry=entry)
                continue
            events.put(event="start", shape=shape, method=name)
            launch, refused, sticky = ds.first_launch(method, slots, k)
            if refused is not None:
                if sticky is not None:  # the context is poisoned: stop here
                    entry["refused"] = f"CUDA error left by the launch: {sticky}"[:400]
                    events.put(event="result", entry=entry)
                    events.put(event="poisoned", shape=shape, method=name)
                    return 3
                entry["refused"] = refused
                events.put(event="result", entry=entry)
                print(f"{shape:<10} {name:<18} {'refused':>9} ({entry['refused'][:80]})",
                      flush=True)
                continue
            selection = method.output()
            entry["rows_top_k"] = ds.count_top_k(scores, selection, k)
            if name == "dsa":
                reference, reference_name = selection[:, :k].clone(), "dsa"
            if reference is None:
                reference = torch.topk(scores, k, dim=1).indices
                reference_name = "torch.topk"
            entry["same_set_reference"] = reference_name
            entry["rows_same_set"] = ds.count_same_set(selection, reference, k)
            entry["us"] = round(ds.median_us(launch, flush, args.reps, args.warmup), 2)
            if name == "dsa":
                ours_us = entry["us"]
            else:
                entry["dsa_us_same_process"] = ours_us
            events.put(event="result", entry=entry)
            ratio = f"{entry['us'] / ours_us:7.2f}x" if ours_us else f"{'':>8}"
            print(f"{shape:<10} {name:<18} {entry['us']:9.1f} {ratio} "
                  f"{entry['rows_same_set']:>5} of {rows:<3} {entry['rows_top_k']:>5} of {rows:<3}",
                  flush=True)
        events.put(event="shape_done", shape=shape)
        del scores, table, reference
        torch.cuda.empty_cache()
    return 0


# ---- the parent: a child a group, restarted past a crash ------------------------------------

def _read_events(path: str, offset: int):
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        text = f.read()
    # only whole lines; a partial last line waits for the next read
    end = text.rfind("\n") + 1
    lines = [json.loads(line) for line in text[:end].splitlines() if line.strip()]
    return lines, offset + len(text[:end].encode("utf-8"))


def run_group(group: str, methods: List[str], shapes, args, log) -> List[dict]:
    """Runs one group's children until every shape is done; returns their events."""
    remaining = list(shapes)
    all_events: List[dict] = []
    skipped: Dict[str, str] = {}
    attempt = 0
    while remaining:
        attempt += 1
        run_methods = [m for m in methods if m not in skipped]
        if time.time() > args.deadline:
            log(f"{group}: the time budget (--budget-s {args.budget_s:.0f}) ran out before it")
            for shape, rows, slots in remaining:
                for m in ["dsa"] + run_methods:
                    all_events.append({"event": "result", "entry": {
                        "shape": shape, "rows": rows, "slots": slots, "method": m, "us": None,
                        "rows_same_set": None, "rows_top_k": None,
                        "refused": "not run: the time budget (--budget-s) ran out"}})
            break
        events_path = os.path.join(args.work_dir, f"{group}_{attempt}.jsonl")
        open(events_path, "w").close()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", group, "--events",
               events_path, "--peers-dir", args.peers_dir, "--build-dir", args.build_dir,
               "--shapes", ",".join(s for s, _, _ in remaining), "--scores", args.scores,
               "--k", str(args.k), "--methods", ",".join(run_methods) or "none",
               "--reps", str(args.reps), "--warmup", str(args.warmup), "--out", os.devnull]
        log(f"== {group} (child {attempt}): {len(remaining)} shapes, methods "
            f"{','.join(run_methods) or '(ours only)'}")
        proc = subprocess.Popen(cmd)
        offset, last_progress = 0, time.time()
        mine: List[dict] = []
        in_flight: Optional[dict] = None
        loading = True
        stalled = out_of_time = False
        while True:
            rc = proc.poll()
            got, offset = _read_events(events_path, offset)
            if got:
                last_progress = time.time()
            for e in got:
                mine.append(e)
                if e["event"] == "start":
                    in_flight = e
                elif e["event"] in ("result", "shape_done"):
                    in_flight = None
                elif e["event"] == "loaded":
                    loading = False
            if rc is not None:
                break
            limit = args.build_timeout_s if loading else args.stall_s
            if time.time() - last_progress > limit:
                stalled = True
                proc.kill()
                proc.wait()
                break
            if time.time() > args.deadline:
                out_of_time = True
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        got, offset = _read_events(events_path, offset)
        mine.extend(got)
        for e in got:
            if e["event"] == "start":
                in_flight = e
            elif e["event"] in ("result", "shape_done"):
                in_flight = None
        all_events.extend(mine)
        done = {e["shape"] for e in mine if e["event"] == "shape_done"}
        if out_of_time:
            log(f"{group}: the time budget (--budget-s {args.budget_s:.0f}) ran out")
            for shape, rows, slots in remaining:
                if shape in done:
                    continue
                reported = {e["entry"]["method"] for e in all_events
                            if e["event"] == "result" and e["entry"]["shape"] == shape}
                for m in ["dsa"] + run_methods:
                    if m not in reported:
                        all_events.append({"event": "result", "entry": {
                            "shape": shape, "rows": rows, "slots": slots, "method": m,
                            "us": None, "rows_same_set": None, "rows_top_k": None,
                            "refused": "not run: the time budget (--budget-s) ran out"}})
            break
        if proc.returncode == 0 and not stalled:
            remaining = [s for s in remaining if s[0] not in done]
            if remaining:  # exited cleanly without finishing: do not loop forever
                log(f"{group}: child exited 0 with {len(remaining)} shapes not done")
                for shape, rows, slots in remaining:
                    for m in ["dsa"] + run_methods:
                        all_events.append({"event": "result", "entry": {
                            "shape": shape, "rows": rows, "slots": slots, "method": m,
                            "us": None, "rows_same_set": None, "rows_top_k": None,
                            "refused": "not run (the child stopped early)"}})
                remaining = []
            break
        how = (f"stopped reporting for {args.stall_s:.0f} s (killed)" if stalled
               else f"exited with {proc.returncode}"
               + (" (signal %d)" % -proc.returncode if proc.returncode < 0 else ""))
        poisoned = [e for e in mine if e["event"] == "poisoned"]
        failed_shape = None
        if poisoned:
            failed_shape = poisoned[-1]["shape"]
        elif in_flight is not None:
            failed_shape = in_flight["shape"]
            all_events.append({"event": "result", "entry": {
                "shape": in_flight["shape"], "method": in_flight["method"], "us": None,
                "rows_same_set": None, "rows_top_k": None,
                "refused": f"the process {how} during this method"}})
            if stalled:
                skipped[in_flight["method"]] = (f"not run: stalled on {in_flight['shape']} "
                                                "(see there)")
        elif loading:
            log(f"{group}: child {how} while building or loading; giving up on the group")
            for shape, rows, slots in remaining:
                for m in run_methods:
                    all_events.append({"event": "result", "entry": {
                        "shape": shape, "rows": rows, "slots": slots, "method": m, "us": None,
                        "rows_same_set": None, "rows_top_k": None,
                        "refused": f"the process {how} while building or loading the peer"}})
            break
        log(f"{group}: child {how}"
            + (f" in {in_flight['method']} on {in_flight['shape']}" if in_flight else ""))
        # go on after the shape that failed (its other methods are lost with it unless reported)
        names = [s[0] for s in remaining]
        if failed_shape in names:
            cut = names.index(failed_shape) + 1
        else:
            cut = max([names.index(s) + 1 for s in done if s in names] + [1])
        lost = remaining[:cut]
        for shape, rows, slots in lost:
            reported = {e["entry"]["method"] for e in all_events
                        if e["event"] == "result" and e["entry"]["shape"] == shape}
            for m in ["dsa"] + run_methods:
                if m not in reported:
                    all_events.append({"event": "result", "entry": {
                        "shape": shape, "rows": rows, "slots": slots, "method": m, "us": None,
                        "rows_same_set": None, "rows_top_k": None,
                        "refused": f"not run: the process {how} earlier in this shape"}})
        remaining = remaining[cut:]
        for m, why in skipped.items():
            for shape, rows, slots in remaining:
                all_events.append({"event": "result", "entry": {
                    "shape": shape, "rows": rows, "slots": slots, "method": m, "us": None,
                    "rows_same_set": None, "rows_top_k": None, "refused": why}})
    return all_events


def run_parent(args, write) -> dict:
    """Runs every group; calls write(report) after each group (a partial report) and returns
    the whole one."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_DOCS]
    if unknown:
        raise BenchError(f"--methods: unknown {unknown}; known: {ALL_METHODS}")
    methods = [m for m in ALL_METHODS if m in methods]
    shapes = ds.parse_shapes(args.shapes)
    os.makedirs(args.work_dir, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    groups = [g for g in GROUPS if any(METHOD_DOCS[m][0] == g for m in methods)]
    if not groups:  # ours only: one child of the first group with no peer method
        groups = [GROUPS[0]]
    device, torch_version = None, None
    results_by_key: Dict[tuple, dict] = {}
    loads = {}
    def report() -> dict:
        results = []
        for shape, rows, slots in shapes:
            for m in methods:
                entry = results_by_key.get((shape, m))
                if entry is None:
                    entry = {"shape": shape, "rows": rows, "slots": slots, "method": m,
                             "us": None, "rows_same_set": None, "rows_top_k": None,
                             "refused": "not reported"}
                entry.setdefault("rows", rows)
                entry.setdefault("slots", slots)
                results.append(entry)
        return {
            "device": device,
            "k": args.k,
            "scores": args.scores,
            "source": "bench/peers/topk_frameworks_bench.py",
            "torch": torch_version,
            "peers": {g: {"built_or_loaded_s": loads.get(g, {}).get("seconds"),
                          "error": loads.get(g, {}).get("error"),
                          "build": loads.get(g, {}).get("build"),
                          "origin": _peer_origin(args.peers_dir, g)} for g in groups},
            "timing": f"median of {args.reps} after {args.warmup} warm-ups, CUDA events, 256 MiB "
                      "written before each run; each peer group in a child process of its own, "
                      "ours timed in each (dsa_us_same_process)",
            "methods": {m: METHOD_DOCS[m][1] for m in methods},
            "results": results,
        }

    for group in groups:
        group_methods = [m for m in methods if METHOD_DOCS[m][0] == group]
        for e in run_group(group, group_methods, shapes, args, log):
            if e["event"] == "device":
                device, torch_version = e["name"], e["torch"]
            elif e["event"] == "loaded":
                loads[group] = e
            elif e["event"] == "result":
                entry = e["entry"]
                key = (entry["shape"], entry["method"])
                if entry["method"] == "dsa" and "dsa" not in methods:
                    continue
                if key in results_by_key and results_by_key[key].get("us") is not None:
                    continue  # the dsa row of an earlier child
                results_by_key[key] = entry
        write(report())
    return report()


def _peer_origin(peers_dir: str, group: str) -> Optional[str]:
    """The first line of the peer folder's ORIGIN file (what was extracted from where)."""
    sub = {"vllm": "vllm", "sgl": "sgl_kernel", "sglang": "sglang_jit"}[group]
    path = os.path.join(peers_dir, sub, "ORIGIN")
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def build_only(args) -> int:
    """Compiles the groups of --methods, one after the other, and reports each."""
    groups = [g for g in GROUPS if any(METHOD_DOCS[m][0] == g
                                       for m in args.methods.split(",") if m in METHOD_DOCS)]
    rc = 0
    for group in groups:
        t0 = time.time()
        try:
            load_group(group, args.peers_dir, args.build_dir, verbose=True)
            print(f"built {group} in {time.time() - t0:.0f} s", flush=True)
        except Exception as e:
            print(f"{group} failed to build or load ({time.time() - t0:.0f} s): "
                  f"{type(e).__name__}: {e}", flush=True)
            rc = 1
    return rc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers-dir", required=True,
                        help="the folder holding vllm/, sgl_kernel/, sglang_jit/ (sources and "
                             "bindings)")
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--build-dir", default="/tmp/topk_peers_build",
                        help="where torch.utils.cpp_extension builds the peers "
                             "(default: %(default)s)")
    parser.add_argument("--work-dir", default=None,
                        help="where the children's event logs go (default: beside --out)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="ROWSxSLOTS,... (default: %(default)s)")
    parser.add_argument("--scores", choices=["bell", "equal"], default="bell")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--methods", default=",".join(ALL_METHODS),
                        help="comma list of %s (default: all)" % ", ".join(ALL_METHODS))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--stall-s", type=float, default=60.0,
                        help="end a child that reports nothing for this long "
                             "(default: %(default)s)")
    parser.add_argument("--build-timeout-s", type=float, default=420.0,
                        help="the same while a child builds or loads its peer "
                             "(default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="stop all children after this many seconds, the shapes not reached "
                             "reported as not run (0: no limit; default: %(default)s)")
    parser.add_argument("--build-only", action="store_true",
                        help="only compile the peer groups of --methods (into --build-dir)")
    parser.add_argument("--child", choices=GROUPS, help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.k not in (512, 1024, 2048):
        parser.error("--k must be 512, 1024 or 2048 (the K the peers' DSA kernels take)")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    args.deadline = time.time() + args.budget_s if args.budget_s > 0 else float("inf")
    if args.work_dir is None:
        args.work_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_events"
    try:
        if args.build_only:
            return build_only(args)
        if args.child:
            return run_child(args)
        run_parent(args, lambda report: _write_json(args.out, report))
    except BenchError as e:
        print(f"topk_frameworks_bench: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def _write_json(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
