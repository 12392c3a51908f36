"""append: every byte of the pool equals the CPU fp8 reference (torch.float8_e4m3fn, scale =
amax / 448, round-to-nearest-even), fp32 and bf16 keys, several head_dims, partial blocks,
scattered block tables, and bytes outside the written slots untouched."""
import pytest
import torch

from reference import BLOCK, quantize_cpu, write_pool_cpu

if torch.cuda.is_available():
    import dsa_kernels as dk


def special_keys(n, D, gen):
    keys = torch.randn(n, D, generator=gen) * (2.0 ** torch.randint(-20, 21, (n, 1), generator=gen))
    if n > 4:
        keys[0] = 0.0                      # all zero: scale 0, codes 0
        keys[1] = -0.0
        keys[2] = torch.randn(D, generator=gen) * 1e-40  # fp32 denormals: a denormal scale
        keys[3] = torch.randn(D, generator=gen) * 3e37   # near FLT_MAX / 10
        keys[4, 0] = 448.0                 # scale exactly 1 ...
        keys[4, 1:] = torch.randn(D - 1, generator=gen).clamp(-400, 400) if D > 1 else keys[4, 1:]
    return keys


@pytest.mark.parametrize("D", [128, 64, 40, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_matches_cpu_quantizer(D, dtype):
    gen = torch.Generator().manual_seed(D * 10 + (dtype == torch.bfloat16))
    for first_slot, n in [(0, 1), (0, 150), (1, 63), (37, 64), (63, 2), (64, 65), (5, 0)]:
        num_pool_blocks = (first_slot + n) // BLOCK + 4
        pool_cpu = torch.randint(0, 256, (num_pool_blocks, BLOCK * (D + 4)), generator=gen, dtype=torch.uint8)
        table = torch.randperm(num_pool_blocks, generator=gen).to(torch.int32)
        keys = special_keys(n, D, gen).to(dtype)
        pool = pool_cpu.cuda()
        dk.append(pool, table.cuda(), keys.cuda(), first_slot)
        codes, scales = quantize_cpu(keys)
        expected = pool_cpu.clone()
        write_pool_cpu(expected, table, first_slot, codes, scales, D)
        got = pool.cpu()
        if not torch.equal(got, expected):
            diff = (got != expected).nonzero()
            raise AssertionError(f"D={D} {dtype} first_slot={first_slot} n={n}: {diff.shape[0]} bytes "
                                 f"differ, first at (block, byte) {diff[0].tolist()}: got "
                                 f"{int(got[tuple(diff[0])])} expected {int(expected[tuple(diff[0])])}")


def test_append_rounding_midpoints():
    """Every E4M3 rounding midpoint +-1 ulp through keys whose scale is exactly 1 (amax 448)."""
    codes = torch.arange(0, 0x7e, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    mids = (values[:-1] + values[1:]) / 2
    pts = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    pts = torch.cat([pts, -pts])
    D = 128
    n = -(-pts.numel() // (D - 1))
    keys = torch.zeros(n * (D - 1))
    keys[:pts.numel()] = pts
    keys = torch.cat([torch.full((n, 1), 448.0), keys.view(n, D - 1)], dim=1)
    blocks = -(-n // BLOCK)
    pool = torch.zeros(blocks, BLOCK * (D + 4), dtype=torch.uint8)
    table = torch.arange(blocks, dtype=torch.int32)
    expected = pool.clone()
    c, s = quantize_cpu(keys)
    assert bool((s == 1.0).all())
    write_pool_cpu(expected, table, 0, c, s, D)
    pool = pool.cuda()
    dk.append(pool, table.cuda(), keys.cuda(), 0)
    assert torch.equal(pool.cpu(), expected)


def test_append_empty_is_noop():
    pool = torch.full((2, BLOCK * 132), 7, dtype=torch.uint8, device="cuda")
    dk.append(pool, torch.zeros(0, dtype=torch.int32, device="cuda"),
              torch.zeros(0, 128, device="cuda"), 0)
    assert bool((pool == 7).all())
