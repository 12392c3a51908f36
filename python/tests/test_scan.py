"""scan against the torch reference (dequantized pool, einsum, ReLU, head weights, key scale, fp64):
rtol 1e-3 plus the fp32 reordering bound where the head sum cancels, -inf exactly where masked;
contexts 0/1/63/64/65/2047/2048/2049/16385/131072 slots, 1..64 rows, all blocks or a shuffled
subset, garbage in unfilled slots, both kernels and every query_prep."""
import pytest
import torch

from reference import assert_scores_close, make_batch, reference_scan

if torch.cuda.is_available():
    import dsa_kernels as dk

CONTEXTS = [0, 1, 63, 64, 65, 2047, 2048, 2049, 16385]


def run_scan(b, kernel, query_prep="auto", tables="padded"):
    bt = b.padded_tables() if tables == "padded" else b.tables
    return dk.scan(b.pool, b.group_first_row, b.group_block_offset, b.logical_blocks, bt, b.num_slots,
                   b.query, b.weights, b.position, kernel=kernel, query_prep=query_prep)


def check(b, kernel, query_prep="auto", what="", tables="padded"):
    got = run_scan(b, kernel, query_prep, tables)
    ref, bound, _ = reference_scan(b)
    assert_scores_close(got, ref, bound, what=f"{kernel}/{query_prep} {what}")


@pytest.mark.parametrize("query_prep", ["auto", "workspace", "in_kernel"])
@pytest.mark.parametrize("H,D", [(64, 128), (16, 64), (32, 128)])
@pytest.mark.parametrize("subset", [False, True])
def test_tensor_cores_ragged(H, D, query_prep, subset):
    rows = [1 + i % 4 for i in range(len(CONTEXTS))]
    b = make_batch(CONTEXTS, rows, H, D, subset=subset, seed=H + D + subset, past_end_row=True)
    check(b, "tensor_cores", query_prep, f"H={H} D={D} subset={subset}")


@pytest.mark.parametrize("qdtype,H,D", [(torch.float32, 64, 128), (torch.bfloat16, 64, 128),
                                        (torch.float32, 3, 40)])
@pytest.mark.parametrize("subset", [False, True])
def test_cuda_cores_ragged(qdtype, H, D, subset):
    rows = [1 + i % 4 for i in range(len(CONTEXTS))]
    b = make_batch(CONTEXTS, rows, H, D, query_dtype=qdtype, subset=subset, seed=7 + H + subset,
                   past_end_row=True)
    check(b, "cuda_cores", what=f"{qdtype} H={H} D={D} subset={subset}", tables="list")


@pytest.mark.parametrize("kernel", ["tensor_cores", "cuda_cores"])
def test_131072_slots_4_verifier_rows(kernel):
    b = make_batch([131072], [4], 64, 128, seed=3)
    check(b, kernel, what="131072 x 4")


@pytest.mark.parametrize("kernel", ["tensor_cores", "cuda_cores"])
@pytest.mark.parametrize("groups,rows", [(64, 1), (16, 4), (1, 64), (1, 1)])
def test_rows_1_to_64(kernel, groups, rows):
    gen = torch.Generator().manual_seed(groups * 100 + rows)
    contexts = torch.randint(1, 5000, (groups,), generator=gen).tolist()
    b = make_batch(contexts, [rows] * groups, 64, 128, seed=groups + rows, subset=groups == 16)
    check(b, kernel, what=f"{groups} groups x {rows} rows")


def test_tiny_and_large_queries():
    for scale in (2.0 ** 20, 2.0 ** -30):
        b = make_batch([2049, 65, 1], [2, 1, 3], 64, 128, seed=11, query_scale=scale)
        check(b, "tensor_cores", "workspace", f"query scale {scale}")
        check(b, "tensor_cores", "in_kernel", f"query scale {scale}")


def test_no_blocks_and_no_rows():
    b = make_batch([0, 0], [1, 0], 64, 128, seed=5)
    for kernel in ("tensor_cores", "cuda_cores"):
        assert run_scan(b, kernel).numel() == 0


def test_kernels_agree_and_layout():
    b = make_batch([2049, 130], [3, 2], 64, 128, seed=9, subset=True)
    tc = run_scan(b, "tensor_cores")
    cc = run_scan(b, "cuda_cores")
    layout = dk.scan_layout(b.group_first_row, b.group_block_offset, "cuda")
    assert tc.numel() == layout.total_entries
    assert layout.row_num_entries.tolist() == [int(b.group_block_offset[1]) * 64] * 3 + \
        [int(b.group_block_offset[2] - b.group_block_offset[1]) * 64] * 2
    finite = torch.isfinite(cc)
    assert torch.equal(finite, torch.isfinite(tc))
    close = (tc[finite] - cc[finite]).abs() <= 1e-2 * cc[finite].abs() + 1e-4
    assert float(close.double().mean()) >= 0.999
