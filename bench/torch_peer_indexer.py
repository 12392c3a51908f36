#!/usr/bin/env python3
"""The PyTorch peer of the lightning indexer's decode select: what a team without custom kernels
would write, timed beside our kernels in the same GPU run (docs/gpu_kernels.md, docs/benchmarks.md).

Per row: index scores z[i] = s_i * sum_h w_h * ReLU(q_h . k_i) over `slots` keys stored fp8 e4m3
with one fp32 scale per slot (DeepSeek-V3.2's cache layout), widened to bf16 for one batched matmul
with the bf16 queries [H=64, D=128]; then torch.topk of K=2048. Each figure is the median of CUDA
event times over 100 launches, with the L2 cache overwritten before each (cold keys, as at decode).

usage: python3 torch_peer_indexer.py [--shapes ROWSxSLOTS,...] [--json OUT]
Imported by python/bench_dsa_kernels.py (--reference), which calls run(rows, slots).
"""
import argparse
import json
import statistics

import torch

NUM_HEADS, HEAD_DIM, TOP_K = 64, 128, 2048
WARMUP, RUNS = 10, 100
L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2


def median_us(fn, flush):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(RUNS):
        flush.zero_()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def run(rows, slots, flush=None):
    """Times scan and top-K at one shape; returns {rows, slots, scan_us, topk_us, key_bytes}."""
    if flush is None:
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(rows * 7919 + slots)
    raw = torch.randn(rows, slots, HEAD_DIM, device="cuda", generator=gen)
    key_scale = raw.abs().amax(dim=-1, keepdim=True) / 448.0  # e4m3's largest finite value
    keys_fp8 = (raw / key_scale).to(torch.float8_e4m3fn)
    del raw
    scales = key_scale.squeeze(-1)
    queries = torch.randn(rows, NUM_HEADS, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    head_weights = torch.randn(rows, NUM_HEADS, device="cuda", generator=gen)

    def scan():
        per_head = torch.bmm(keys_fp8.to(torch.bfloat16), queries.transpose(1, 2))  # [rows, slots, H]
        return (torch.relu(per_head).float() * head_weights[:, None, :]).sum(dim=-1) * scales

    scores = scan()
    result = {
        "rows": rows,
        "slots": slots,
        "scan_us": median_us(scan, flush),
        "topk_us": median_us(lambda: torch.topk(scores, min(TOP_K, slots), dim=1), flush),
        "key_bytes": rows * slots * (HEAD_DIM + 4),  # fp8 key + fp32 scale a slot
    }
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x16384,1x65536,1x131072,1x1048576,8x65536,64x65536")
    parser.add_argument("--json", help="write the results here as a JSON list")
    args = parser.parse_args()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = []
    print(f"{'rows':>5} {'slots':>8} {'scan_us':>10} {'topk_us':>10} {'scan_GB/s':>10}")
    for shape in args.shapes.split(","):
        rows, slots = (int(v) for v in shape.lower().split("x"))
        r = run(rows, slots, flush)
        results.append(r)
        print(f"{rows:5d} {slots:8d} {r['scan_us']:10.1f} {r['topk_us']:10.1f} "
              f"{r['key_bytes'] / r['scan_us'] / 1e3:10.1f}")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
