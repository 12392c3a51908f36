"""Bad inputs: each raises ValueError naming the argument (from the Python layer or the C++
bindings), and shapes the kernels refuse raise their CanImplement reason."""
import pytest
import torch

from reference import make_batch

if torch.cuda.is_available():
    import dsa_kernels as dk

D = 128


def pool_and_table():
    return torch.zeros(4, 64 * (D + 4), dtype=torch.uint8, device="cuda"), \
        torch.arange(4, dtype=torch.int32, device="cuda")


def test_append_errors():
    pool, table = pool_and_table()
    keys = torch.randn(10, D, device="cuda")
    with pytest.raises(ValueError, match="'keys' must be a CUDA tensor"):
        dk.append(pool, table, keys.cpu(), 0)
    with pytest.raises(ValueError, match="'keys' must be float32 or bfloat16"):
        dk.append(pool, table, keys.half(), 0)
    with pytest.raises(ValueError, match="'keys' must be contiguous"):
        dk.append(pool, table, torch.randn(D, 10, device="cuda").t(), 0)
    with pytest.raises(ValueError, match="'pool' must be uint8 \\[num_blocks, 64"):
        dk.append(torch.zeros(4, 64 * D, dtype=torch.uint8, device="cuda"), table, keys, 0)
    with pytest.raises(ValueError, match="'pool' must be uint8"):
        dk.append(pool.view(torch.int8), table, keys, 0)
    with pytest.raises(ValueError, match="'block_table' must have at least"):
        dk.append(pool, table[:1], torch.randn(100, D, device="cuda"), 0)
    with pytest.raises(ValueError, match="'block_table' holds pool block ids outside"):
        dk.append(pool, torch.tensor([9], dtype=torch.int32), keys, 0)
    with pytest.raises(ValueError, match="'first_slot' must be >= 0"):
        dk.append(pool, table, keys, -1)
    # The bindings check too (and report instead of throwing), when called directly.
    kind, message = dk._C.append(pool, table.long(), keys, 0)
    assert kind == 1 and "argument 'block_table' must be int32, got int64" in message
    with pytest.raises(ValueError, match="'block_table' must have an integer dtype"):
        dk.append(pool, table.float(), keys, 0)


def test_scan_errors():
    b = make_batch([300], [2], 64, D, seed=1)
    args = lambda **kw: dict(dict(pool=b.pool, group_first_row=b.group_first_row,
                                  group_block_offset=b.group_block_offset,
                                  logical_blocks=b.logical_blocks, block_tables=b.padded_tables(),
                                  group_num_slots=b.num_slots, query=b.query,
                                  head_weights=b.weights, row_position=b.position), **kw)
    dk.scan(**args())  # the good call
    with pytest.raises(ValueError, match="CanImplementScanTensorCores.*query_dtype is not bf16"):
        dk.scan(**args(query=b.query.float()))
    with pytest.raises(ValueError, match="num_heads is not 16, 32 or 64"):
        dk.scan(**args(query=b.query[:, :3].contiguous(), head_weights=b.weights[:, :3].contiguous()))
    with pytest.raises(ValueError, match="'head_weights' must be float32 \\[num_rows, num_heads\\]"):
        dk.scan(**args(head_weights=b.weights[:, :8].contiguous()))
    with pytest.raises(ValueError, match="'head_weights' must be float32"):
        dk.scan(**args(head_weights=b.weights.double()))
    with pytest.raises(ValueError, match="'query' must be contiguous"):
        dk.scan(**args(query=b.query.transpose(1, 2).contiguous().transpose(1, 2)))
    with pytest.raises(ValueError, match="'query' must be a CUDA tensor"):
        dk.scan(**args(query=b.query.cpu()))
    with pytest.raises(ValueError, match="'kernel' must be"):
        dk.scan(**args(), kernel="fast")
    with pytest.raises(ValueError, match="'query_prep' must be"):
        dk.scan(**args(), query_prep="sometimes")
    with pytest.raises(ValueError, match="'group_first_row' must end at num_rows"):
        dk.scan(**args(group_first_row=[0, 1]))
    with pytest.raises(ValueError, match="'group_block_offset' must be non-decreasing"):
        dk.scan(**args(group_block_offset=[0, 5, 2], group_first_row=[0, 1, 2]))
    with pytest.raises(ValueError, match="'logical_blocks'"):
        dk.scan(**args(logical_blocks=torch.tensor([0, 1, 2, 3, 9])))
    with pytest.raises(ValueError, match="'pool' must be uint8 \\[num_blocks, 64 \\* \\(head_dim \\+ 4\\)\\]"):
        dk.scan(**args(pool=torch.zeros(8, 64 * 68, dtype=torch.uint8, device="cuda")))
    with pytest.raises(ValueError, match="CanImplementScanCudaCores.*head_dim outside"):
        q = torch.randn(2, 2, 300, device="cuda")
        dk.scan(**args(query=q, head_weights=torch.randn(2, 2, device="cuda"),
                       pool=torch.zeros(8, 64 * 304, dtype=torch.uint8, device="cuda")),
                kernel="cuda_cores", check_indices=False)
    # The C++ layer checks too, when called directly.
    layout = dk.scan_layout(b.group_first_row, b.group_block_offset)
    kind, message = dk._C.scan_into(
        b.pool, b.group_first_row.cuda(), b.group_block_offset.cuda(), layout.total_blocks,
        b.logical_blocks.int().cuda(), torch.zeros(1, dtype=torch.int64, device="cuda"),
        b.tables[0], b.num_slots.cuda(), b.query, b.weights, b.position.cuda(), layout.row_offsets,
        torch.empty(layout.total_entries, device="cuda"), "tensor_cores", "auto")
    assert kind == 1 and "argument 'group_first_row' must be int32, got int64" in message


def test_topk_errors():
    s = torch.randn(2, 100, device="cuda")
    with pytest.raises(ValueError, match="'k' must be in \\[1, 2048\\]"):
        dk.topk(s, k=0)
    with pytest.raises(ValueError, match="'k' must be in \\[1, 2048\\]"):
        dk.topk(s, k=4096)
    with pytest.raises(ValueError, match="'scores' must be float32"):
        dk.topk(s.double(), k=5)
    with pytest.raises(ValueError, match="'scores' must be a CUDA tensor"):
        dk.topk(s.cpu(), k=5)
    with pytest.raises(ValueError, match="go together"):
        dk.topk(s, k=5, logical_blocks=[0, 1])
    with pytest.raises(ValueError, match="'row_num_entries' must have 2 entries"):
        dk.topk(s.view(-1), [0, 100], [100], [5, 5], 5)
    with pytest.raises(ValueError, match="'row_offsets' and 'row_num_entries' are required"):
        dk.topk(s.view(-1), k=5)
    with pytest.raises(ValueError, match="'max_row_entries' must be >= 0"):
        dk.topk(s, k=5, max_row_entries=-1)
    # The binding's own check (what CallTopK refuses), with no row to select as well.
    sel = torch.empty(0, 5, dtype=torch.int32, device="cuda")
    none = torch.empty(0, dtype=torch.int64, device="cuda")
    kind, message = dk._C.topk_into(s.view(-1), none, none, none, 5, None, None, sel, -3)
    assert kind == 1 and "'max_row_entries' must be >= 0" in message, message


def test_spin_errors():
    v = torch.rand(100, device="cuda")
    with pytest.raises(ValueError, match="target_block_sparsity must be in \\[0, 1\\)"):
        dk.spin_plan([99], v, v, top_k=8, target_block_sparsity=1.0)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        dk.spin_plan([99], v, v, top_k=0)
    with pytest.raises(ValueError, match="'vertical\\[r\\]' must be float32"):
        dk.spin_plan([99], v.double(), v, top_k=8)
    with pytest.raises(ValueError, match="one tensor a row"):
        dk.spin_plan([99, 5], [v], [v, v], top_k=8)
