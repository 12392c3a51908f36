#!/usr/bin/env python3
"""Times dsa_kernels' scan, top-K and select next to the PyTorch peer (torch_peer_indexer.py)
in the same process: one row per sequence, H = 64, D = 128, all blocks, bf16 query, K = 2048.

Ours: CUDA events around each launch, a 256 MiB memset before each run (L2 flushed, and the GPU
busy while the host enqueues the launch), 5 warm-ups, median of 30. "kernel" calls the bindings
with prepared tensors (dsa_kernels._C); "call" goes through the Python layer (with a precomputed
layout, no index checks). The peer is timed by its own run() (triton do_bench, median).

usage: python bench_dsa_kernels.py --reference /path/to/torch_peer_indexer.py
           [--shapes 1x65536,64x65536] [--json OUT]
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsa_kernels as dk  # noqa: E402

H, D, K = 64, 128, 2048
WARMUP, RUNS = 5, 30


def load_reference(path):
    spec = importlib.util.spec_from_file_location("torch_reference_indexer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_us(fn, flush):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(RUNS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def run(rows, slots, flush):
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + slots)
    blocks_per_row = slots // 64
    pool = dk.new_pool(rows * blocks_per_row, D, dev)
    table = torch.arange(rows * blocks_per_row, dtype=torch.int32, device=dev)
    chunk = 1 << 20  # keys appended a million at a time (the fp32 keys of 64 x 64K are 2 GiB)
    for first in range(0, rows * slots, chunk):
        n = min(chunk, rows * slots - first)
        dk.append(pool, table, torch.randn(n, D, device=dev, generator=g), first, check_indices=False)
    q = torch.randn(rows, H, D, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(rows, H, device=dev, generator=g)
    first_row = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    block_offset = torch.arange(rows + 1, dtype=torch.int64, device=dev) * blocks_per_row
    logical = (torch.arange(rows * blocks_per_row, device=dev) % blocks_per_row).to(torch.int32)
    table_offset = torch.arange(rows, dtype=torch.int64, device=dev) * blocks_per_row
    num_slots = torch.full((rows,), slots, dtype=torch.int64, device=dev)
    position = torch.full((rows,), slots - 1, dtype=torch.int64, device=dev)
    layout = dk.scan_layout(torch.arange(rows + 1), torch.arange(rows + 1) * blocks_per_row, dev)
    scores = torch.empty(layout.total_entries, dtype=torch.float32, device=dev)

    def scan_kernel(kernel):
        return lambda: dk._raise_if_error(dk._C.scan_into(
            pool, first_row, block_offset, layout.total_blocks, logical, table_offset, table,
            num_slots, q, w, position, layout.row_offsets, scores, kernel, "auto"))

    selection = torch.empty(rows, K, dtype=torch.int32, device=dev)

    def topk_kernel():
        dk._raise_if_error(dk._C.topk_into(scores, layout.row_offsets, layout.row_num_entries,
                                           position, K, None, None, selection,
                                           layout.max_row_entries))
        return selection

    def scan_call():
        return dk.scan(pool, first_row, block_offset, logical, table, num_slots, q, w, position,
                       group_table_offset=table_offset, layout=layout, check_indices=False)

    scan_kernel("tensor_cores")()
    res = {"rows": rows, "slots": slots}
    res["scan_tc_us"] = time_us(scan_kernel("tensor_cores"), flush)
    res["scan_tc_call_us"] = time_us(scan_call, flush)
    res["scan_cc_us"] = time_us(scan_kernel("cuda_cores"), flush)
    scan_kernel("tensor_cores")()
    res["topk_us"] = time_us(topk_kernel, flush)
    res["topk_call_us"] = time_us(lambda: dk.topk(scores, layout.row_offsets,
                                                  layout.row_num_entries, position, K,
                                                  max_row_entries=layout.max_row_entries), flush)
    # select, end to end through the Python layer (layout and checks included: host reads)
    res["select_call_us"] = time_us(
        lambda: dk.select(pool, table.view(rows, blocks_per_row), num_slots, q, w, position, K,
                          check_indices=False), flush)
    # a sanity check of what was timed: our top-K of our scores against torch.topk of them
    sel = topk_kernel()
    ref = torch.topk(scores.view(rows, slots), K, dim=1).indices.to(torch.int32)
    res["topk_matches_torch"] = bool(torch.equal(torch.sort(sel, 1).values, torch.sort(ref, 1).values))
    res["key_bytes"] = rows * slots * (D + 4)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", required=True, help="path of torch_peer_indexer.py")
    ap.add_argument("--shapes", default="1x65536,64x65536")
    ap.add_argument("--json")
    a = ap.parse_args()
    ref = load_reference(a.reference)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = []
    for shape in a.shapes.split(","):
        rows, slots = (int(x) for x in shape.split("x"))
        o = run(rows, slots, flush)
        torch.cuda.empty_cache()  # the pool and keys of run() are free now
        peer = ref.run(rows, slots)
        torch.cuda.empty_cache()
        o["torch_scan_us"], o["torch_topk_us"] = peer["scan_us"], peer["topk_us"]
        out.append(o)
    print(f"{'shape':>9} {'scan_tc':>8} {'(call)':>8} {'scan_cc':>8} {'topk':>7} {'(call)':>7} "
          f"{'select':>8} {'torch_scan':>10} {'torch_topk':>10} {'scan x':>7} {'topk x':>7} {'GB/s':>6}")
    for o in out:
        print(f"{o['rows']:>3}x{o['slots']:<5} {o['scan_tc_us']:8.1f} {o['scan_tc_call_us']:8.1f} "
              f"{o['scan_cc_us']:8.1f} {o['topk_us']:7.1f} {o['topk_call_us']:7.1f} "
              f"{o['select_call_us']:8.1f} {o['torch_scan_us']:10.1f} {o['torch_topk_us']:10.1f} "
              f"{o['torch_scan_us'] / o['scan_tc_us']:7.1f} {o['torch_topk_us'] / o['topk_us']:7.1f} "
              f"{o['key_bytes'] / o['scan_tc_us'] / 1e3:6.0f}")
    print("all times us (median); 'scan x' / 'topk x': the peer's time over ours; GB/s: key bytes "
          "over the tensor-core scan time; top-K sets equal torch.topk's: "
          + str(all(o["topk_matches_torch"] for o in out)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
