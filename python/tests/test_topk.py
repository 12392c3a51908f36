"""topk against torch.topk on distinct scores and against a stable-sort reference of DSA's rule
(score descending, ties to the lower slot; -inf, NaN and slots past the position never selected;
-1 padding), rows of length 0, the scan layout through shuffled block lists, 1..300 rows."""
import math

import pytest
import torch

from reference import reference_topk_row

if torch.cuda.is_available():
    import dsa_kernels as dk

SLOTS = [0, 1, 63, 64, 65, 2047, 2048, 2049, 16385, 131072]


def distinct_scores(rows, n, gen):
    out = torch.empty(rows, n)
    for r in range(rows):
        # distinct floats: a permutation of 0..n-1, affinely mapped (exact below 2^24)
        out[r] = (torch.randperm(n, generator=gen).float() - n / 3) * 0.5
    return out


@pytest.mark.parametrize("n", SLOTS)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_distinct_scores_match_torch_topk(n, rows):
    gen = torch.Generator().manual_seed(n + rows)
    scores = distinct_scores(rows, n, gen).cuda()
    for k in (2048, 100, 1):
        got = dk.topk(scores, k=k)
        assert got.shape == (rows, k) and got.dtype == torch.int32
        take = min(k, n)
        expected = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
        if take > 0:
            expected[:, :take] = torch.topk(scores, take, dim=1).indices.to(torch.int32)
        assert torch.equal(got, expected), f"rows={rows} n={n} k={k}"


@pytest.mark.parametrize("n", SLOTS)
def test_ties_masks_and_position(n):
    gen = torch.Generator().manual_seed(1000 + n)
    rows = 5
    palette = torch.tensor([0.0, -0.0, 1.0, 2.0, -math.inf, math.nan, math.inf, 1.5e-45, -3.0])
    scores = palette[torch.randint(0, palette.numel(), (rows, n), generator=gen)].cuda()
    max_slot = torch.tensor([n - 1, n // 2, 0, -1, n + 10], dtype=torch.int64)
    for k in (2048, 100, 1):
        got = dk.topk(scores, None, None, max_slot.cuda(), k)
        slots = torch.arange(n, device="cuda")
        for r in range(rows):
            exp = reference_topk_row(scores[r], slots, int(max_slot[r]), k)
            assert torch.equal(got[r], exp), f"n={n} k={k} row {r}"


def test_all_equal_rows():
    for n in (131072, 2049):
        scores = torch.zeros(2, n, device="cuda")
        scores[1, ::2] = -0.0
        got = dk.topk(scores, k=2048)
        expected = torch.arange(2048, dtype=torch.int32, device="cuda")
        expected[min(n, 2048):] = -1
        assert torch.equal(got[0], expected) and torch.equal(got[1], expected)


def test_ragged_rows_with_zero_length():
    gen = torch.Generator().manual_seed(3)
    lengths = [0, 5, 0, 3000, 1, 0, 70000] + [int(x) for x in torch.randint(0, 5000, (293,), generator=gen)]
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n + 17)  # gaps between rows are never read
    total = offsets[-1] + lengths[-1] + 17
    flat = torch.randn(total, generator=gen).cuda()
    max_slot = torch.randint(-1, 6000, (len(lengths),), generator=gen)
    got = dk.topk(flat, torch.tensor(offsets), torch.tensor(lengths), max_slot, 2048)
    assert got.shape == (300, 2048)
    for r in range(len(lengths)):
        row = flat[offsets[r]:offsets[r] + lengths[r]]
        exp = reference_topk_row(row, torch.arange(lengths[r], device="cuda"), int(max_slot[r]), 2048)
        assert torch.equal(got[r], exp), f"row {r} (length {lengths[r]})"


def test_scan_layout_block_lists_with_ties():
    """Entries map to slots through shuffled logical blocks: ties go to the lower slot, not entry."""
    gen = torch.Generator().manual_seed(4)
    rows_blocks = [0, 1, 3, 40, 2050]
    offsets, block_offsets, blocks, flat = [], [], [], []
    o = bo = 0
    for nb in rows_blocks:
        offsets.append(o)
        block_offsets.append(bo)
        perm = torch.randperm(max(nb, 1) * 2, generator=gen)[:nb]  # distinct, not all blocks
        blocks.append(perm)
        flat.append(torch.randint(0, 4, (nb * 64,), generator=gen).float())
        o += nb * 64
        bo += nb
    flat = torch.cat(flat).cuda()
    blocks = torch.cat(blocks).to(torch.int32)
    lengths = torch.tensor(rows_blocks) * 64
    max_slot = torch.tensor([10**9, 10**9, 100, 1000, 10**9])
    for k in (2048, 64, 1):
        got = dk.topk(flat, torch.tensor(offsets), lengths, max_slot, k, blocks.cuda(),
                      torch.tensor(block_offsets))
        for r, nb in enumerate(rows_blocks):
            mine = blocks[block_offsets[r]:block_offsets[r] + nb].long()
            slots = (mine[:, None] * 64 + torch.arange(64)[None, :]).reshape(-1).cuda()
            exp = reference_topk_row(flat[offsets[r]:offsets[r] + nb * 64], slots, int(max_slot[r]), k)
            assert torch.equal(got[r], exp), f"row {r} k={k}"


def test_no_rows():
    got = dk.topk(torch.zeros(0, 10, device="cuda"), k=5)
    assert got.shape == (0, 5)


@pytest.mark.parametrize("bound", [None, 0, 1, 4096, 1 << 20])
def test_host_bound_never_changes_the_selection(bound):
    # The bound picks a kernel, never a result (which kernel ran is topk_test.cc's to check,
    # through sampled_fallbacks). 1 and 4096 take the kernel without the sampled gather for every
    # batch, so the 2^20-entry row (64K entries a CTA, past what a CTA holds) goes through that
    # kernel's streamed select; None (each batch's width) takes it up to 512K entries a row; 0
    # (no bound) and 2^20 (past what 16 CTAs hold) take the sampled kernel.
    gen = torch.Generator().manual_seed(7)
    for rows, n in ((1, 16385), (3, 131072), (9, 2049), (1, 1 << 20)):
        scores = distinct_scores(rows, n, gen).cuda()
        got = dk.topk(scores, k=2048, max_row_entries=bound)
        take = min(2048, n)
        expected = torch.full((rows, 2048), -1, dtype=torch.int32, device="cuda")
        expected[:, :take] = torch.topk(scores, take, dim=1).indices.to(torch.int32)
        assert torch.equal(got, expected), f"bound={bound} rows={rows} n={n}"

