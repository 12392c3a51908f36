"""spin_plan: S[j] equal to the reference max pooling of max(V[i], D[t - i]), and the plan (sink
and newest block, then the best by S, ties to the lower block) equal to the reference."""
import pytest
import torch

from reference import spin_reference_row

if torch.cuda.is_available():
    import dsa_kernels as dk

POSITIONS = [-1, 0, 1, 63, 64, 65, 2047, 2048, 2049, 16385, 131072]


@pytest.mark.parametrize("top_k,rho", [(2048, 0.4), (64, 0.4), (128, 0.9), (64, 0.0), (2048, 0.7)])
def test_spin_plan_matches_reference(top_k, rho):
    gen = torch.Generator().manual_seed(top_k + int(rho * 10))
    vs, ds, pos = [], [], []
    for t in POSITIONS:
        for kind in ("full", "half", "empty", "ties"):
            n = max(t + 1, 0)
            if kind == "full":
                v, d = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
            elif kind == "half":
                v, d = torch.rand(n // 2, generator=gen), torch.rand(n // 3, generator=gen)
            elif kind == "empty":
                v, d = torch.zeros(0), torch.zeros(0)
            else:
                v = torch.randint(0, 3, (n,), generator=gen).float()
                d = torch.randint(0, 3, (n,), generator=gen).float()
            vs.append(v.cuda())
            ds.append(d.cuda())
            pos.append(t)
    out = dk.spin_plan(torch.tensor(pos), vs, ds, top_k=top_k, target_block_sparsity=rho)
    offsets = out.row_block_offset.cpu()
    for r, t in enumerate(pos):
        S, plan = spin_reference_row(t, vs[r], ds[r], top_k, rho)
        B = S.numel()
        o = int(offsets[r])
        got_S = out.block_scores[o:o + B].cpu()
        assert torch.equal(got_S, S), f"row {r} t={t}: S differs"
        count = int(out.selected_count[r])
        assert count == len(plan), f"row {r} t={t}: {count} blocks, expected {len(plan)}"
        assert out.selected[o:o + count].cpu().tolist() == plan, f"row {r} t={t}: plan differs"


def test_spin_scores_only_and_shared_state():
    v = torch.rand(5000, device="cuda")
    d = torch.rand(5000, device="cuda")
    out = dk.spin_plan([4999, 4998, -1], v, d, top_k=256, plan=False)
    assert out.selected is None and out.selected_count is None
    assert out.block_scores.numel() == 2 * (4999 // 64 + 1)
