"""dsa_kernels: PyTorch bindings of the DSA lightning-indexer CUDA kernels (indexer_service/cuda).

Index scores z_t[i] = s_i * sum_h w_t,h * ReLU(q_t,h . k_i) over a paged fp8 e4m3 index-key cache,
then the K best slots per query row (DESIGN.md 2 and 4.1). Every function takes and returns torch
CUDA tensors and runs on the current torch CUDA stream of the tensors' device (asynchronously,
unless a docstring says it reads something back to the host).

Terms and layouts
-----------------
slot
    One token position of a sequence's index-key cache, 0-based.
block
    64 consecutive slots; logical block j holds slots [64 j, 64 j + 64).
pool
    uint8 [num_blocks, 64 * (head_dim + 4)]: each pool block is 64 x head_dim fp8 e4m3 codes
    (slot-major), then 64 fp32 scales (indexer_service/block_pool.h). A key is code * scale.
block table
    int32 [>= ceil(num_slots / 64)]: logical block j of a sequence lives in pool block table[j].
group
    The rows of one sequence (one query row at decode, several verifier rows with speculative
    decoding) that score the same blocks; they share every key read.
scan layout
    Row r of group g gets len(blocks of g) * 64 fp32 scores starting at row_offsets[r]; entry
    j * 64 + s is the score of slot blocks[j] * 64 + s, or -inf for a slot past the row's position
    or the group's filled slots.

Validation: every tensor is checked for device, dtype, contiguity and shape (ValueError naming the
argument); a shape the kernel refuses raises ValueError with the kernel's CanImplement reason; a
failed launch raises RuntimeError. (The bindings in dsa_kernels._C report these as (kind, message)
results rather than throwing; this layer raises them.)
With check_indices=True (the default) the index arrays are also read back to the host (a
synchronization) and checked for range; pass False on hot paths once the inputs are trusted.
"""
from __future__ import annotations

import operator
from typing import List, NamedTuple, Optional, Sequence, Union

import torch

from . import _C

__all__ = [
    "BLOCK_SLOTS", "MAX_TOPK", "block_bytes", "new_pool", "append", "ScanLayout", "scan_layout",
    "scan", "topk", "SpinPlan", "spin_plan", "select", "device_info",
]

#: Slots per block of the paged cache (kBlockSize).
BLOCK_SLOTS: int = 64
#: Largest K of the top-K kernel.
MAX_TOPK: int = int(_C.MAX_TOPK)

IndexLike = Union[torch.Tensor, Sequence[int]]


def block_bytes(head_dim: int) -> int:
    """Bytes of one pool block: 64 * (head_dim + 4) (64 fp8 codes of head_dim, 64 fp32 scales)."""
    return BLOCK_SLOTS * (head_dim + 4)


def new_pool(num_blocks: int, head_dim: int, device: Union[str, torch.device] = "cuda") -> torch.Tensor:
    """A zeroed block pool: uint8 [num_blocks, 64 * (head_dim + 4)] on `device`."""
    return torch.zeros(num_blocks, block_bytes(head_dim), dtype=torch.uint8, device=device)


# ---- helpers --------------------------------------------------------------------------------

def _device_of(t: torch.Tensor, name: str) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"argument '{name}' must be a CUDA tensor, got a tensor on {t.device}")
    return t.device


def _index(value: IndexLike, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An index array as a contiguous 1-D `dtype` tensor on `device` (any integer input dtype)."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"argument '{name}' must be a tensor or a sequence of ints: {e}") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"argument '{name}' must have an integer dtype, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"argument '{name}' must be 1-D, got shape {tuple(value.shape)}")
    if value.device.type == "cuda" and value.device != device:
        raise ValueError(f"argument '{name}' must be on {device}, got {value.device}")
    return value.to(device=device, dtype=dtype).contiguous()


def _host(value: IndexLike) -> torch.Tensor:
    """A CPU int64 copy (reads a CUDA tensor back: a synchronization)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.int64)
    return torch.as_tensor(value, dtype=torch.int64)


def _raise_if_error(result) -> None:
    """Raises what a binding reported: (0, "") is success, (1, msg) a ValueError (a bad argument
    or a shape the kernel refuses: CanImplement's reason), (2, msg) a RuntimeError (the launch)."""
    kind, message = result
    if kind == 1:
        raise ValueError(message)
    if kind != 0:
        raise RuntimeError(message)


def _check_offsets(host: torch.Tensor, name: str, last: Optional[int] = None, what: str = "") -> None:
    if host.dim() != 1 or host.numel() < 1:
        raise ValueError(f"argument '{name}' must be 1-D with at least one entry")
    if int(host[0]) != 0:
        raise ValueError(f"argument '{name}' must start at 0, got {int(host[0])}")
    if host.numel() > 1 and bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"argument '{name}' must be non-decreasing")
    if last is not None and int(host[-1]) != last:
        raise ValueError(f"argument '{name}' must end at {what} = {last}, got {int(host[-1])}")


# ---- append ---------------------------------------------------------------------------------

def append(pool: torch.Tensor, block_table: IndexLike, keys: torch.Tensor, first_slot: int,
           check_indices: bool = True) -> None:
    """Quantizes `keys` into the pool, in place: slots [first_slot, first_slot + num_keys).

    pool: uint8 [num_blocks, 64 * (head_dim + 4)], CUDA, contiguous (written in place).
    block_table: int [>= ceil((first_slot + num_keys) / 64)] pool block ids of the sequence's
        logical blocks (any integer dtype, host or device; sent as int32).
    keys: float32 or bfloat16 [num_keys, head_dim], CUDA, contiguous, finite; head_dim in [1, 1024].
    first_slot: first slot written (>= 0); may fall inside a partly filled block.

    Per key: scale = amax / 448 (IEEE fp32 division), code[d] = E4M3(key[d] / scale) with
    round-to-nearest-even, saturating; an all-zero key (or one whose scale underflows) stores
    scale 0 and zero codes. Bit-identical to the CPU quantizer (common/fp8.h).
    """
    device = _device_of(keys, "keys")
    if check_indices and isinstance(pool, torch.Tensor) and keys.dim() == 2:
        needed = -(-(int(first_slot) + keys.shape[0]) // BLOCK_SLOTS)
        host = _host(block_table)
        if keys.shape[0] > 0 and host.numel() >= needed and needed > 0:
            used = host[:needed]
            if bool((used < 0).any()) or bool((used >= pool.shape[0]).any()):
                raise ValueError(f"argument 'block_table' holds pool block ids outside "
                                 f"[0, {pool.shape[0]}) in its first {needed} entries")
    _raise_if_error(_C.append(pool, _index(block_table, "block_table", torch.int32, device), keys,
                              int(first_slot)))


# ---- scan -----------------------------------------------------------------------------------

class ScanLayout(NamedTuple):
    """Where each row's scores sit in the scan layout (all int64 CUDA tensors but the counts).

    row_offsets: [num_rows] first entry of row r in the scores.
    row_num_entries: [num_rows] entries of row r (64 x its group's block count).
    row_block_offset: [num_rows] where row r's blocks start in logical_blocks (its group's).
    total_blocks: blocks of all groups (an int).
    total_entries: entries of all rows, the length of the scores (an int).
    max_row_entries: the most entries of one row (an int; topk's host bound).
    """
    row_offsets: torch.Tensor
    row_num_entries: torch.Tensor
    row_block_offset: torch.Tensor
    total_blocks: int
    total_entries: int
    max_row_entries: int = 0


def scan_layout(group_first_row: IndexLike, group_block_offset: IndexLike,
                device: Union[str, torch.device] = "cuda") -> ScanLayout:
    """The scan layout of a batch (reads both arrays to the host: a synchronization if on a GPU).

    group_first_row: int [num_groups + 1], from 0, non-decreasing: rows of group g are
        [group_first_row[g], group_first_row[g + 1]).
    group_block_offset: int [num_groups + 1], from 0, non-decreasing: blocks of group g are
        logical_blocks[group_block_offset[g] : group_block_offset[g + 1]].
    """
    rows = _host(group_first_row)
    blocks = _host(group_block_offset)
    _check_offsets(rows, "group_first_row")
    _check_offsets(blocks, "group_block_offset")
    if rows.numel() != blocks.numel():
        raise ValueError(f"arguments 'group_first_row' ({rows.numel()} entries) and "
                         f"'group_block_offset' ({blocks.numel()}) must both have num_groups + 1")
    rows_per_group = rows[1:] - rows[:-1]
    row_blocks = torch.repeat_interleave(blocks[1:] - blocks[:-1], rows_per_group)
    row_num_entries = row_blocks * BLOCK_SLOTS
    row_offsets = torch.cumsum(row_num_entries, 0) - row_num_entries
    row_block_offset = torch.repeat_interleave(blocks[:-1], rows_per_group)
    device = torch.device(device)
    return ScanLayout(row_offsets.to(device), row_num_entries.to(device),
                      row_block_offset.to(device), int(blocks[-1]), int(row_num_entries.sum()),
                      int(row_num_entries.max()) if row_num_entries.numel() > 0 else 0)


def _block_tables(block_tables, group_table_offset, num_groups: int, device: torch.device):
    """(flat int32 tables, int64 group_table_offset) from a 2-D table, a list or a flat one."""
    if isinstance(block_tables, (list, tuple)):
        if len(block_tables) != num_groups:
            raise ValueError(f"argument 'block_tables' must hold one table a group ({num_groups}), "
                             f"got {len(block_tables)}")
        tables = [_index(t, f"block_tables[{g}]", torch.int32, device) for g, t in enumerate(block_tables)]
        lengths = torch.tensor([0] + [t.numel() for t in tables], dtype=torch.int64)
        flat = torch.cat(tables) if tables else torch.empty(0, dtype=torch.int32, device=device)
        return flat, torch.cumsum(lengths, 0)[:-1].to(device)
    if not isinstance(block_tables, torch.Tensor):
        raise ValueError("argument 'block_tables' must be a tensor [num_groups, W], a flat tensor "
                         "with group_table_offset, or a list of one 1-D table a group")
    if block_tables.dim() == 2:
        if group_table_offset is not None:
            raise ValueError("argument 'group_table_offset' must be None when 'block_tables' is 2-D")
        if block_tables.shape[0] != num_groups:
            raise ValueError(f"argument 'block_tables' must be [num_groups = {num_groups}, W], got "
                             f"shape {tuple(block_tables.shape)}")
        width = block_tables.shape[1]
        offsets = torch.arange(num_groups, dtype=torch.int64, device=device) * width
        return _index(block_tables.reshape(-1), "block_tables", torch.int32, device), offsets
    if group_table_offset is None:
        raise ValueError("argument 'group_table_offset' is required with a 1-D 'block_tables'")
    return (_index(block_tables, "block_tables", torch.int32, device),
            _index(group_table_offset, "group_table_offset", torch.int64, device))


def scan(pool: torch.Tensor, group_first_row: IndexLike, group_block_offset: IndexLike,
         logical_blocks: IndexLike, block_tables, group_num_slots: IndexLike, query: torch.Tensor,
         head_weights: torch.Tensor, row_position: IndexLike, *,
         group_table_offset: Optional[IndexLike] = None, kernel: str = "tensor_cores",
         query_prep: str = "auto", layout: Optional[ScanLayout] = None,
         check_indices: bool = True) -> torch.Tensor:
    """Index scores of a ragged batch of groups, in the scan layout.

    pool: uint8 [num_blocks, 64 * (head_dim + 4)], CUDA (see the module doc).
    group_first_row: int [num_groups + 1]: rows of group g are [first[g], first[g + 1]).
    group_block_offset: int [num_groups + 1]: blocks of group g are
        logical_blocks[offset[g] : offset[g + 1]].
    logical_blocks: int [total_blocks]: logical block ids, each < ceil(num_slots / 64) of its
        group; any order.
    block_tables: int32 [num_groups, W] (group g's table is row g), or a list of num_groups 1-D
        tables, or a flat 1-D tensor with group_table_offset (int64 [num_groups]).
    group_num_slots: int [num_groups]: filled slots of each group's cache (slots at or past it
        score -inf).
    query: bfloat16 or float32 [num_rows, num_heads, head_dim], CUDA, contiguous.
    head_weights: float32 [num_rows, num_heads], CUDA (w_t,h with the query scale folded in).
    row_position: int [num_rows]: the row's query position t; slots above it score -inf.
    kernel: "tensor_cores" (f16 mma, bf16 queries, head_dim 64 or 128, num_heads 16, 32 or 64;
        scores as the reference with the query rounded to bf16, up to accumulation order) or
        "cuda_cores" (fp32 FMA; any num_heads, head_dim <= 256, fp32 or bf16 queries).
    query_prep: tensor cores only: "auto", "workspace" or "in_kernel" (where the bf16 query is
        converted to f16; same scores). The workspace is allocated here, with torch.
    layout: the batch's ScanLayout, if already computed (skips the host read of the offsets).

    Returns float32 [layout.total_entries]: row r's entries from layout.row_offsets[r] (unitless
    index scores; -inf where masked). Reads the offsets to the host unless `layout` is given, and
    the index arrays when check_indices.
    """
    device = _device_of(query, "query")
    _device_of(pool, "pool")
    if layout is None:
        layout = scan_layout(group_first_row, group_block_offset, device)
        rows = _host(group_first_row)
        if isinstance(query, torch.Tensor) and query.dim() == 3 and int(rows[-1]) != query.shape[0]:
            raise ValueError(f"argument 'group_first_row' must end at num_rows = {query.shape[0]} "
                             f"(query's first dimension), got {int(rows[-1])}")
    first_row = _index(group_first_row, "group_first_row", torch.int32, device)
    num_groups = first_row.numel() - 1
    blocks = _index(logical_blocks, "logical_blocks", torch.int32, device)
    if blocks.numel() != layout.total_blocks:
        raise ValueError(f"argument 'logical_blocks' must have group_block_offset[-1] = "
                         f"{layout.total_blocks} entries, got {blocks.numel()}")
    tables, table_offset = _block_tables(block_tables, group_table_offset, num_groups, device)
    num_slots = _index(group_num_slots, "group_num_slots", torch.int64, device)
    block_offset = _index(group_block_offset, "group_block_offset", torch.int64, device)
    if check_indices:
        _check_scan_indices(pool, blocks, block_offset, tables, table_offset, num_slots)
    scores = torch.empty(layout.total_entries, dtype=torch.float32, device=device)
    _raise_if_error(_C.scan_into(
        pool, first_row, block_offset, layout.total_blocks, blocks, table_offset, tables, num_slots,
        query, head_weights, _index(row_position, "row_position", torch.int64, device),
        layout.row_offsets, scores, kernel, query_prep))
    return scores


def _check_scan_indices(pool, blocks, block_offset, tables, table_offset, num_slots) -> None:
    """Range checks of the scan's index arrays on the host (a synchronization)."""
    blocks_h, offset_h = blocks.cpu().long(), block_offset.cpu()
    tables_h, table_offset_h, slots_h = tables.cpu().long(), table_offset.cpu(), num_slots.cpu()
    if bool((slots_h < 0).any()):
        raise ValueError("argument 'group_num_slots' must be >= 0")
    for g in range(slots_h.numel()):
        mine = blocks_h[int(offset_h[g]):int(offset_h[g + 1])]
        if mine.numel() == 0:
            continue
        limit = -(-int(slots_h[g]) // BLOCK_SLOTS)
        if bool((mine < 0).any()) or bool((mine >= limit).any()):
            raise ValueError(f"argument 'logical_blocks': group {g} names a block outside "
                             f"[0, ceil(num_slots / 64) = {limit})")
        ids = int(table_offset_h[g]) + mine
        if bool((ids < 0).any()) or bool((ids >= tables_h.numel()).any()):
            raise ValueError(f"argument 'block_tables': group {g}'s table is shorter than its blocks")
        pool_ids = tables_h[ids]
        if bool((pool_ids < 0).any()) or bool((pool_ids >= pool.shape[0]).any()):
            raise ValueError(f"argument 'block_tables': group {g} maps a block outside the pool "
                             f"[0, {pool.shape[0]})")


# ---- top-K ----------------------------------------------------------------------------------

def topk(scores: torch.Tensor, row_offsets: Optional[IndexLike] = None,
         row_num_entries: Optional[IndexLike] = None, row_max_slot: Optional[IndexLike] = None,
         k: int = 2048, logical_blocks: Optional[IndexLike] = None,
         row_block_offset: Optional[IndexLike] = None,
         max_row_entries: Optional[int] = None) -> torch.Tensor:
    """The K best slots of each row, best first, with DSA's rules.

    scores: float32, CUDA, contiguous: [num_rows, width] (then row_offsets and row_num_entries
        may be None: row r is scores[r]) or flat [total] with row_offsets and row_num_entries.
    row_offsets: int [num_rows]: first entry of each row in the flat scores.
    row_num_entries: int [num_rows]: entries of each row, in [0, 2^31); 0 gives an all -1 row.
    row_max_slot: int [num_rows]: the row's position t; slots above it are never selected
        (None: no bound).
    k: K in [1, 2048].
    logical_blocks, row_block_offset: the scan layout (both or neither): entry e of row r is slot
        logical_blocks[row_block_offset[r] + e // 64] * 64 + e % 64; without them entry e is slot e.
    max_row_entries: a host bound on every row's entries (an int >= 0, 0: none; None: the width
        of a 2-D `scores` whose row_num_entries is None, else none; scan_layout's
        max_row_entries for the scan's scores). Where it says every row fits the
        kernel's shared-memory chunks, the kernel without the sampled gather runs (less code to
        fetch after a cold L2; topk.h TopKParams::max_row_entries). A row past it is still
        selected exactly, more slowly. ValueError when negative.

    Returns int32 [num_rows, k]: slots by score descending, ties to the lower slot; -inf, NaN and
    slots past row_max_slot are never selected; -1 pads past the selectable entries.
    """
    device = _device_of(scores, "scores")
    if row_offsets is None or row_num_entries is None:
        if scores.dim() != 2:
            raise ValueError("argument 'row_offsets' and 'row_num_entries' are required unless "
                             f"'scores' is 2-D [num_rows, width]; got shape {tuple(scores.shape)}")
        rows, width = scores.shape
        if row_offsets is None:
            row_offsets = torch.arange(rows, dtype=torch.int64, device=device) * width
        if row_num_entries is None:
            row_num_entries = torch.full((rows,), width, dtype=torch.int64, device=device)
            if max_row_entries is None:
                max_row_entries = width
    offsets = _index(row_offsets, "row_offsets", torch.int64, device)
    if row_max_slot is None:
        row_max_slot = torch.full((offsets.numel(),), 2**62, dtype=torch.int64, device=device)
    if (logical_blocks is None) != (row_block_offset is None):
        raise ValueError("arguments 'logical_blocks' and 'row_block_offset' go together")
    return _topk(scores, offsets, _index(row_num_entries, "row_num_entries", torch.int64, device),
                 _index(row_max_slot, "row_max_slot", torch.int64, device), k,
                 None if logical_blocks is None else _index(logical_blocks, "logical_blocks", torch.int32, device),
                 None if row_block_offset is None else _index(row_block_offset, "row_block_offset", torch.int64, device),
                 max_row_entries)


def _topk(scores, offsets, num_entries, max_slot, k, logical_blocks, row_block_offset,
          max_row_entries=None) -> torch.Tensor:
    """topk over arguments already of the kernel's dtypes, on the scores' device."""
    k = int(k)
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"topk: argument 'k' must be in [1, {MAX_TOPK}], got {k}")
    bound = 0 if max_row_entries is None else operator.index(max_row_entries)
    if bound < 0:
        raise ValueError(f"topk: argument 'max_row_entries' must be >= 0 (0: no bound), got {bound}")
    selection = torch.empty(offsets.numel(), k, dtype=torch.int32, device=scores.device)
    _raise_if_error(_C.topk_into(scores, offsets, num_entries, max_slot, k, logical_blocks,
                                 row_block_offset, selection, bound))
    return selection


# ---- SPIN block prediction ------------------------------------------------------------------

class SpinPlan(NamedTuple):
    """SPIN's predicted block scores and plan for a batch of rows.

    block_scores: float32 [total_blocks]: S[j] of row r at block_scores[row_block_offset[r] + j],
        j in [0, B_r), B_r = t_r // 64 + 1 (0 for t_r < 0).
    row_block_offset: int64 [num_rows], CUDA.
    selected: int32 [total_blocks] or None: row r's chosen blocks, ascending, at
        selected[row_block_offset[r] + i], i < selected_count[r]; -1 past the count.
    selected_count: int32 [num_rows] or None.
    """
    block_scores: torch.Tensor
    row_block_offset: torch.Tensor
    selected: Optional[torch.Tensor]
    selected_count: Optional[torch.Tensor]


def spin_plan(positions: IndexLike, vertical: Union[torch.Tensor, List[torch.Tensor]],
              diagonal: Union[torch.Tensor, List[torch.Tensor]], top_k: int = 2048,
              target_block_sparsity: float = 0.4, plan: bool = True,
              device: Union[str, torch.device, None] = None) -> SpinPlan:
    """SPIN block prediction (A1 reduction, max pooling) and the plan without exploration.

    positions: int [num_rows]: the row's position t (rows see slots [0, t]; t < 0 sees nothing).
        Read to the host to size the outputs (a synchronization if on a GPU).
    vertical, diagonal: the sequence's V (per slot) and D (per offset) EMAs, float32 CUDA: a list
        of num_rows 1-D tensors (rows may share one), or one 1-D tensor for all rows, or a 2-D
        [num_rows, len] tensor; entries past a tensor's length read as 0.
    top_k: K of the model (>= 1); rows with t + 1 <= top_k take all their blocks.
    target_block_sparsity: rho in [0, 1); the budget is
        m_t = min(B, max(ceil(K / 64), ceil((1 - rho) B))).
    plan: also choose the blocks (the sink block 0, the newest block, then the best by S, ties to
        the lower block); False gives only the block scores.

    Returns a SpinPlan. Bit-identical to SpinState::PredictBlockScores and, for the plan, the same
    blocks as SpinState::Plan with exploration_fraction = 0 (indexer_service/spin.h).
    """
    if device is None:
        for t in (vertical, diagonal, positions):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                device = t.device
                break
            if isinstance(t, (list, tuple)) and t and isinstance(t[0], torch.Tensor) and t[0].device.type == "cuda":
                device = t[0].device
                break
        else:
            device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    pos_h = _host(positions)
    if pos_h.dim() != 1:
        raise ValueError(f"argument 'positions' must be 1-D, got shape {tuple(pos_h.shape)}")
    num_rows = pos_h.numel()

    def per_row(value, name):
        if isinstance(value, torch.Tensor):
            if value.dim() == 1:
                return [value] * num_rows
            if value.dim() == 2 and value.shape[0] == num_rows:
                return list(value.unbind(0))
            raise ValueError(f"argument '{name}' must be 1-D, [num_rows, len] or a list, got "
                             f"shape {tuple(value.shape)}")
        if len(value) != num_rows:
            raise ValueError(f"argument '{name}' must hold one tensor a row ({num_rows}), got {len(value)}")
        return list(value)

    row_blocks = torch.where(pos_h < 0, torch.zeros_like(pos_h), pos_h // BLOCK_SLOTS + 1)
    offsets_h = torch.cumsum(row_blocks, 0) - row_blocks
    total = int(row_blocks.sum())
    row_block_offset = offsets_h.to(device)
    block_scores = torch.empty(total, dtype=torch.float32, device=device)
    selected = selected_count = None
    if plan:
        selected = torch.full((total,), -1, dtype=torch.int32, device=device)
        selected_count = torch.zeros(num_rows, dtype=torch.int32, device=device)
    _raise_if_error(_C.spin_predict(
        _index(pos_h, "positions", torch.int64, device), per_row(vertical, "vertical"),
        per_row(diagonal, "diagonal"), row_block_offset, block_scores, selected, selected_count,
        int(top_k), float(target_block_sparsity), 0.0))
    return SpinPlan(block_scores, row_block_offset, selected, selected_count)


# ---- select ---------------------------------------------------------------------------------

def select(pool: torch.Tensor, block_tables, group_num_slots: IndexLike, query: torch.Tensor,
           head_weights: torch.Tensor, row_position: IndexLike, k: int = 2048, *,
           group_first_row: Optional[IndexLike] = None,
           group_block_offset: Optional[IndexLike] = None,
           logical_blocks: Optional[IndexLike] = None,
           group_table_offset: Optional[IndexLike] = None, kernel: str = "tensor_cores",
           query_prep: str = "auto", check_indices: bool = True) -> torch.Tensor:
    """Scan of the given blocks (or of every filled block) then top-K, for a batch, in one call.

    group_first_row: int [num_groups + 1] (None: one row a group, num_groups = num_rows).
    logical_blocks / group_block_offset: the blocks each group scores (both or neither; None:
        every block of the group's filled slots, 0 .. ceil(num_slots / 64) - 1).
    Other arguments as in scan(); k as in topk() (row_max_slot = row_position).

    Returns int32 [num_rows, k]: the K best slots of each row, best first, ties to the lower slot,
    -1 padding (the same as topk() over scan()'s scores).
    """
    device = _device_of(query, "query")
    if query.dim() != 3:
        raise ValueError(f"argument 'query' must be [num_rows, num_heads, head_dim], got shape "
                         f"{tuple(query.shape)}")
    num_rows = query.shape[0]
    if group_first_row is None:
        group_first_row = torch.arange(num_rows + 1, dtype=torch.int64)
    if (logical_blocks is None) != (group_block_offset is None):
        raise ValueError("arguments 'logical_blocks' and 'group_block_offset' go together")
    if logical_blocks is None:
        slots = _host(group_num_slots)
        counts = -(-slots // BLOCK_SLOTS)
        group_block_offset = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        logical_blocks = (torch.arange(int(counts.sum()), dtype=torch.int64)
                          - torch.repeat_interleave(group_block_offset[:-1], counts))
    layout = scan_layout(group_first_row, group_block_offset, device)
    rows = _host(group_first_row)
    if int(rows[-1]) != num_rows:
        raise ValueError(f"argument 'group_first_row' must end at num_rows = {num_rows}, got "
                         f"{int(rows[-1])}")
    blocks = _index(logical_blocks, "logical_blocks", torch.int32, device)
    position = _index(row_position, "row_position", torch.int64, device)
    scores = scan(pool, group_first_row, group_block_offset, blocks, block_tables, group_num_slots,
                  query, head_weights, position, group_table_offset=group_table_offset,
                  kernel=kernel, query_prep=query_prep, layout=layout, check_indices=check_indices)
    return _topk(scores, layout.row_offsets, layout.row_num_entries, position, k, blocks,
                 layout.row_block_offset, layout.max_row_entries)


def device_info(ordinal: int = 0) -> dict:
    """Properties of GPU `ordinal` and whether the indexer kernels (sm_90a) can run on it."""
    info = _C.device_info(int(ordinal))
    if "error" in info:
        raise RuntimeError(info["error"])
    return info
