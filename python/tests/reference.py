"""Torch references for the dsa_kernels tests: the fp8 quantizer on the CPU, the scan (dequantize,
einsum, ReLU, head weights, key scale) in fp64, top-K by stable sorts, SPIN's prediction and plan,
and a batch builder (a paged pool with garbage in unfilled slots, groups of verifier rows)."""
import math
from dataclasses import dataclass
from typing import List

import torch

BLOCK = 64


def quantize_cpu(keys: torch.Tensor):
    """(codes uint8 [n, D], scales fp32 [n]): scale = amax / 448 (fp32), codes = E4M3(key / scale)
    round-to-nearest-even (torch.float8_e4m3fn), all-zero / underflowing keys -> scale 0, codes 0."""
    k = keys.detach().to("cpu", torch.float32)
    amax = k.abs().amax(dim=1) if k.shape[1] > 0 else torch.zeros(k.shape[0])
    scale = amax / 448.0
    zero = ~(scale > 0)
    safe = torch.where(zero, torch.ones_like(scale), scale)
    codes = (k / safe[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    codes[zero] = 0
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return codes, scale


def write_pool_cpu(pool_cpu: torch.Tensor, block_table, first_slot: int, codes, scales, D: int):
    """Writes quantized keys into a CPU copy of the pool, as the append kernel does."""
    for i in range(codes.shape[0]):
        slot = first_slot + i
        blk = int(block_table[slot // BLOCK])
        s = slot % BLOCK
        pool_cpu[blk, s * D:(s + 1) * D] = codes[i]
        pool_cpu[blk, BLOCK * D + 4 * s:BLOCK * D + 4 * s + 4] = scales[i:i + 1].view(torch.uint8)


def dequantized_slots(pool: torch.Tensor, table: torch.Tensor, num_blocks: int, D: int):
    """(codes as fp64 [num_blocks * 64, D], scales fp64 [num_blocks * 64]) of a sequence's first
    blocks, read through its block table (unfilled slots hold whatever the pool held)."""
    if num_blocks == 0:
        dev = pool.device
        return torch.zeros(0, D, dtype=torch.float64, device=dev), torch.zeros(0, dtype=torch.float64, device=dev)
    blocks = pool[table[:num_blocks].long()]  # [nb, 64 (D + 4)]
    codes = blocks[:, :BLOCK * D].contiguous().view(torch.float8_e4m3fn).reshape(-1, D).to(torch.float64)
    scales = blocks[:, BLOCK * D:].contiguous().view(torch.float32).reshape(-1).to(torch.float64)
    return codes, scales


@dataclass
class Batch:
    pool: torch.Tensor
    D: int
    H: int
    group_first_row: torch.Tensor     # int64 CPU [G + 1]
    group_block_offset: torch.Tensor  # int64 CPU [G + 1]
    logical_blocks: torch.Tensor      # int64 CPU [total_blocks]
    tables: List[torch.Tensor]        # int32 CUDA, one a group
    num_slots: torch.Tensor           # int64 CPU [G]
    query: torch.Tensor               # [R, H, D] CUDA
    weights: torch.Tensor             # fp32 [R, H] CUDA
    position: torch.Tensor            # int64 CPU [R]

    @property
    def num_groups(self):
        return self.num_slots.numel()

    def padded_tables(self):
        width = max([t.numel() for t in self.tables] + [1])
        out = torch.zeros(self.num_groups, width, dtype=torch.int32, device=self.query.device)
        for g, t in enumerate(self.tables):
            out[g, :t.numel()] = t
        return out


def make_batch(contexts, rows_per_group, H, D, query_dtype=torch.bfloat16, subset=False, seed=0,
               query_scale=1.0, device="cuda", past_end_row=False) -> Batch:
    """One ragged batch: group g has contexts[g] filled slots and rows_per_group[g] rows at the
    last positions of its context (verifier rows); with subset, a shuffled ~60% of its blocks;
    the pool starts as random bytes, so unfilled slots hold garbage (NaN codes and scales too)."""
    import dsa_kernels as dk
    gen = torch.Generator().manual_seed(seed)
    blocks_per_group = [math.ceil(c / BLOCK) for c in contexts]
    num_pool_blocks = sum(blocks_per_group) + 3
    pool = torch.randint(0, 256, (num_pool_blocks, BLOCK * (D + 4)), generator=gen, dtype=torch.uint8).to(device)
    perm = torch.randperm(num_pool_blocks, generator=gen)
    tables, used = [], 0
    first_rows, block_offsets, logical, positions = [0], [0], [], []
    for g, (ctx, nb, rows) in enumerate(zip(contexts, blocks_per_group, rows_per_group)):
        table = perm[used:used + nb].to(torch.int32)
        used += nb
        tables.append(table.to(device))
        if ctx > 0:
            keys = torch.randn(ctx, D, generator=gen) * (2.0 ** torch.randint(-4, 5, (ctx, 1), generator=gen))
            dk.append(pool, table, keys.to(device), 0)
        if subset and nb > 1:
            chosen = torch.randperm(nb, generator=gen)[:max(1, (nb * 6) // 10)]
        else:
            chosen = torch.arange(nb)
        logical.append(chosen.to(torch.int64))
        block_offsets.append(block_offsets[-1] + chosen.numel())
        first_rows.append(first_rows[-1] + rows)
        for i in range(rows):
            positions.append(ctx - rows + i)
        if past_end_row and rows > 0:
            positions[-1] = ctx + 5  # a row past the filled slots: the num_slots mask
    R = first_rows[-1]
    q = (torch.randn(R, H, D, generator=gen) * query_scale).to(query_dtype).to(device)
    w = torch.randn(R, H, generator=gen).to(device)
    return Batch(pool, D, H, torch.tensor(first_rows), torch.tensor(block_offsets),
                 torch.cat(logical) if logical else torch.zeros(0, dtype=torch.int64), tables,
                 torch.tensor(contexts, dtype=torch.int64), q, w, torch.tensor(positions, dtype=torch.int64))


def reference_scan(b: Batch):
    """(scores fp64, bound fp64, slots int64), each [total_entries] in the scan layout: the
    reference score, the fp32 reordering bound 2 (D + H + 8) 2^-24 m with
    m = s sum_h |w_h| sum_d |q_hd k_d|, and the slot of each entry."""
    dev = b.query.device
    q = b.query.to(torch.float64)
    w = b.weights.to(torch.float64)
    scores, bounds, slots = [], [], []
    for g in range(b.num_groups):
        r0, r1 = int(b.group_first_row[g]), int(b.group_first_row[g + 1])
        blk = b.logical_blocks[int(b.group_block_offset[g]):int(b.group_block_offset[g + 1])]
        nb = math.ceil(int(b.num_slots[g]) / BLOCK)
        codes, scale = dequantized_slots(b.pool, b.tables[g], nb, b.D)
        entry_slots = (blk[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1).to(dev)
        for r in range(r0, r1):
            if entry_slots.numel() == 0:
                continue
            k = codes[entry_slots]
            s = scale[entry_slots]
            dots = torch.einsum("hd,sd->hs", q[r], k)
            z = (w[r][:, None] * torch.relu(dots)).sum(0) * s
            m = s.abs() * (w[r].abs()[:, None] * torch.einsum("hd,sd->hs", q[r].abs(), k.abs())).sum(0)
            visible = (entry_slots <= int(b.position[r])) & (entry_slots < int(b.num_slots[g]))
            z = torch.where(visible, z, torch.full_like(z, -math.inf))
            m = torch.where(visible, m, torch.zeros_like(m))
            scores.append(z)
            bounds.append(2 * (b.D + b.H + 8) * 2.0 ** -24 * m)
            slots.append(entry_slots)
    if not scores:
        e = torch.zeros(0, dtype=torch.float64, device=dev)
        return e, e, torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.cat(scores), torch.cat(bounds), torch.cat(slots)


def assert_scores_close(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, rtol=1e-3,
                        min_fraction=0.999, what=""):
    """-inf exactly where the reference masks; elsewhere |got - ref| <= rtol |ref| + bound, and at
    least min_fraction of the scores within rtol |ref| outright."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    masked = torch.isinf(ref) & (ref < 0)
    got_masked = torch.isinf(got) & (got < 0)
    assert torch.equal(masked, got_masked), f"{what}: -inf mask differs at {int((masked != got_masked).sum())} entries"
    keep = ~masked
    g, r, bd = got[keep].to(torch.float64), ref[keep], bound[keep]
    assert bool(torch.isfinite(g).all()), f"{what}: non-finite scores where the reference is finite"
    err = (g - r).abs()
    limit = rtol * r.abs() + bd
    bad = err > limit
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {g.numel()} scores off, e.g. got {float(g[i])} "
                             f"ref {float(r[i])} limit {float(limit[i])}")
    if g.numel() > 0:
        within = float((err <= rtol * r.abs()).double().mean())
        assert within >= min_fraction, f"{what}: only {within:.5f} of scores within rtol {rtol}"


def reference_topk_row(scores: torch.Tensor, slots: torch.Tensor, max_slot: int, k: int) -> torch.Tensor:
    """DSA's top-K of one row: the k best selectable entries by (score desc, slot asc), as slots;
    -inf, NaN and slots > max_slot are not selectable; -1 padding. int32 [k] on scores' device."""
    sel = (scores > -math.inf) & (slots <= max_slot)
    idx = sel.nonzero().squeeze(1)
    s, sl = scores[idx].to(torch.float64), slots[idx]
    s = s + 0.0  # -0 and +0 are equal
    o = torch.argsort(sl, stable=True)
    s, sl = s[o], sl[o]
    o = torch.argsort(s, descending=True, stable=True)
    sl = sl[o][:k]
    out = torch.full((k,), -1, dtype=torch.int32, device=scores.device)
    out[:sl.numel()] = sl.to(torch.int32)
    return out


def spin_reference_row(t: int, v: torch.Tensor, d: torch.Tensor, top_k: int, rho: float):
    """(S fp32 [B], plan list) of SpinState::PredictBlockScores / Plan (A1, max, gamma 0)."""
    if t < 0:
        return torch.zeros(0), []
    B = t // BLOCK + 1
    i = torch.arange(t + 1)
    vi = torch.zeros(t + 1)
    n = min(v.numel(), t + 1)
    vi[:n] = v[:n].cpu()
    off = t - i
    di = torch.zeros(t + 1)
    dv = d.cpu()
    ok = off < dv.numel()
    di[ok] = dv[off[ok]]
    slot = torch.maximum(vi, di)
    padded = torch.full((B * BLOCK,), -math.inf)
    padded[:t + 1] = slot
    S = padded.view(B, BLOCK).amax(1)
    if t + 1 <= top_k:
        return S, list(range(B))
    x = (1.0 - rho) * float(B)
    slack = 1e-12 * max(1.0, abs(x))
    budget = min(B, max(-(-top_k // BLOCK), math.ceil(x - slack)))
    forced = [0, B - 1] if B >= 2 else [0]
    capacity = budget - len(forced)
    cands = sorted(range(1, B - 1), key=lambda j: (-float(S[j]), j))[:max(0, capacity)]
    return S, sorted(forced + cands)
