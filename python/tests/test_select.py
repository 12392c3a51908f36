"""select end to end: identical to topk over scan's scores (same kernels, deterministic), and the
scores of the chosen slots equal the reference's K best scores within the scan's tolerance."""
import math

import pytest
import torch

from reference import make_batch, reference_scan

if torch.cuda.is_available():
    import dsa_kernels as dk


def check_against_reference(b, sel, k):
    ref, bound, slots = reference_scan(b)
    layout = dk.scan_layout(b.group_first_row, b.group_block_offset, "cuda")
    for r in range(sel.shape[0]):
        o, n = int(layout.row_offsets[r]), int(layout.row_num_entries[r])
        row_ref, row_bound, row_slots = ref[o:o + n], bound[o:o + n], slots[o:o + n]
        selectable = row_ref > -math.inf
        take = min(k, int(selectable.sum()))
        chosen = sel[r]
        assert bool((chosen[take:] == -1).all()) and bool((chosen[:take] >= 0).all()), f"row {r}"
        if take == 0:
            continue
        by_slot = {int(s): i for i, s in enumerate(row_slots.tolist())}
        idx = torch.tensor([by_slot[int(s)] for s in chosen[:take].tolist()], device=ref.device)
        got_vals = torch.sort(row_ref[idx], descending=True).values
        best_vals = torch.topk(row_ref[selectable], take).values
        tol = 1e-3 * best_vals.abs() + 2 * row_bound.max()
        assert bool(((got_vals - best_vals).abs() <= tol).all()), f"row {r}: chosen scores off"


@pytest.mark.parametrize("kernel", ["tensor_cores", "cuda_cores"])
@pytest.mark.parametrize("k", [2048, 100])
def test_select_given_blocks(kernel, k):
    b = make_batch([1, 65, 2049, 16385, 70000, 0], [1, 2, 3, 4, 2, 1], 64, 128, seed=21, subset=True)
    tables = b.padded_tables()
    sel = dk.select(b.pool, tables, b.num_slots, b.query, b.weights, b.position, k,
                    group_first_row=b.group_first_row, group_block_offset=b.group_block_offset,
                    logical_blocks=b.logical_blocks, kernel=kernel)
    scores = dk.scan(b.pool, b.group_first_row, b.group_block_offset, b.logical_blocks, tables,
                     b.num_slots, b.query, b.weights, b.position, kernel=kernel)
    layout = dk.scan_layout(b.group_first_row, b.group_block_offset, "cuda")
    two_step = dk.topk(scores, layout.row_offsets, layout.row_num_entries, b.position, k,
                       b.logical_blocks, layout.row_block_offset)
    assert torch.equal(sel, two_step)
    check_against_reference(b, sel, k)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_select_all_blocks_one_row_a_sequence(rows):
    gen = torch.Generator().manual_seed(rows)
    contexts = torch.randint(1, 20000, (rows,), generator=gen).tolist()
    b = make_batch(contexts, [1] * rows, 64, 128, seed=rows)
    sel = dk.select(b.pool, b.tables, b.num_slots, b.query, b.weights, b.position, 2048)
    assert sel.shape == (rows, 2048)
    check_against_reference(b, sel, 2048)
