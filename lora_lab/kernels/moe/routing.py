"""Token → expert routing for the fused MoE kernels, built on the device without a host sync.

A mixture-of-experts layer sends each of T tokens to K of E experts. Flatten the (T, K) choice
into S = T·K *assignments*; assignment ``s = t·K + k`` is token ``t``'s k-th expert
``e_s = top_k_index[t, k]`` with routing weight ``w_s = top_k_weights[t, k]``.

The grouped GEMMs work on the assignments sorted by expert, so that expert ``e`` owns the
contiguous block of sorted rows ``[offsets[e], offsets[e+1])``. They never build the sorted
copy of the hidden states: a row looks its token up in ``sorted_token`` and reads X directly.

    perm           = argsort(e_s)  (stable)                 sorted row j ↔ assignment perm[j]
    sorted_slot[j] = perm[j]                                 where its routing weight / gradient lives
    sorted_token[j]= perm[j] // K                            which row of X (and of dX, dOut) it touches
    offsets[e]     = #{s : e_s < e}                          (searchsorted, E + 1 entries)

The GEMMs tile the sorted rows in blocks of BLOCK_M rows that never straddle two experts:
expert ``e`` needs ``ceil(count_e / BLOCK_M)`` tiles. The total is at most
``ceil(S / BLOCK_M) + min(E, S)``, a bound known on the host, so the launch grid is fixed and
no ``.item()`` is needed; tiles past the real total are marked with expert id ``E`` and exit
at once.

Expert ids outside ``[0, E)`` (transformers' expert-parallel sentinels, negative or >= E) sort after the last
expert's block and are simply dropped, as transformers' ``grouped_mm`` path drops them. So ``offsets[0]`` is 0 and
the sorted rows ``[0, offsets[E])`` are exactly ``torch._grouped_mm``'s groups: a grouped GEMM over the sorted rows
never reads a row of no expert.

**How it is built.** Where Triton runs (CUDA, or the interpreter) the sort is a stable counting sort in three
Triton launches (:func:`sort_assignments`): the assignments are cut into blocks of ``ROUTE_BLOCK`` and each id into
a *bin* (e + 1: expert e, E + 1: an id outside [0, E); bin 0 stays empty);

    count   : counts[b, bin]  = #{s in block b : bin(s) = bin}                         one program per block
    scan    : base[b, bin]    = Σ_{b' < b} counts[b', bin],  total[bin]                  one program per 16 bins
    scatter : pos(s) = start[bin] + base[b, bin] + #{s' < s in block b : bin(s') = bin},  start = exclusive
              prefix of total over bins; writes sorted_slot / sorted_token (and the inverse map) at pos; the
              programs of the first tiles also write the row-tile map and the offsets

Before a host-time profile the same routing was a string of small torch ops, each paying its launch on the
host while the GPU waited: at the 30B-A3B-like layer, 8k tokens, full fine-tuning, 46 GPU events ran before the
first expert GEMM (22 of them the stable 64-bit sort), which started 1.37 ms into a traced call (0.89 ms with the
counting sort), and the plain loop went from 7.44 / 7.52 ms to 6.69 / 6.75 ms (H200,
host profiles of 79e9b47 and af954d1 by ``tools/moe_host_profile.py``; the ledger's moe_host_profile rows). The
plain-torch form stays as the reference (:func:`route_experts_torch`)
and for a CPU without the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lora_lab.kernels.triton_helpers import cdiv, next_power_of_2, running_in_interpreter


@dataclass(frozen=True)
class ExpertRouting:
    """Expert-sorted view of a (T, K) routing decision; every tensor lives on the routing device."""

    num_tokens: int
    top_k: int
    num_experts: int
    block_m: int
    sorted_slot: torch.Tensor  # (S,) int32: assignment index s = t*K + k of each sorted row
    sorted_token: torch.Tensor  # (S,) int32: token index t of each sorted row
    expert_offsets: torch.Tensor  # (E + 1,) int32: expert e owns sorted rows [offsets[e], offsets[e+1])
    tile_expert: torch.Tensor  # (max_tiles,) int32: expert of each row tile, E for an unused tile
    tile_row_start: torch.Tensor  # (max_tiles,) int32: first sorted row of each row tile
    position: torch.Tensor | None = None  # (S,) int32: the sorted row of each assignment (``with_position``)

    @property
    def num_assignments(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.numel()

    def nonempty_experts(self) -> list[tuple[int, int, int]]:
        """``(e, lo, hi)`` for every expert that received rows: it owns sorted rows ``[lo, hi)``.

        Reads the offsets on the host (a device sync): for the plain-torch references, never the kernels.
        """
        offsets = self.expert_offsets.tolist()
        return [(e, offsets[e], offsets[e + 1]) for e in range(self.num_experts) if offsets[e + 1] > offsets[e]]


def max_row_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Host-side bound on the number of BLOCK_M row tiles: sum_e ceil(c_e / B) <= ceil(S / B) + min(E, S)."""
    return -(-num_assignments // block_m) + min(num_experts, num_assignments)


def _check_routing_args(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> None:
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be 2-D (tokens, top_k), got shape {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def route_experts(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                  with_position: bool = False) -> ExpertRouting:
    """Sort the assignments by expert and build the row-tile map, all on the device (no host sync): three Triton
    launches where Triton runs (module docstring), the plain-torch form elsewhere. ``with_position``: also the
    inverse map (``ExpertRouting.position``, the sorted row of each assignment)."""
    _check_routing_args(top_k_index, num_experts, block_m)
    num_tokens, top_k = top_k_index.shape
    if num_tokens * top_k == 0 or not (top_k_index.device.type == "cuda" or running_in_interpreter()):
        return route_experts_torch(top_k_index, num_experts, block_m, with_position)
    sort = sort_assignments(top_k_index, num_experts, block_m=block_m, with_position=with_position)
    return ExpertRouting(
        num_tokens=num_tokens, top_k=top_k, num_experts=num_experts, block_m=block_m,
        sorted_slot=sort.sorted_slot, sorted_token=sort.sorted_token, expert_offsets=sort.expert_offsets,
        tile_expert=sort.tile_expert, tile_row_start=sort.tile_row_start, position=sort.position,
    )


def route_experts_torch(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                        with_position: bool = False) -> ExpertRouting:
    """:func:`route_experts` with plain torch ops (a stable sort, searchsorted, cumsum): the reference for the Triton
    form, and the routing on a CPU without Triton's interpreter."""
    _check_routing_args(top_k_index, num_experts, block_m)
    num_tokens, top_k = top_k_index.shape
    device = top_k_index.device
    num_assignments = num_tokens * top_k

    # e_s for s = t*K + k (an id outside [0, E) as E: after every expert), then a stable sort so rows of one expert
    # keep token order (deterministic).
    expert_of_slot = top_k_index.reshape(-1).to(torch.int64)
    expert_of_slot = torch.where((expert_of_slot >= 0) & (expert_of_slot < num_experts), expert_of_slot, num_experts)
    sorted_expert, perm = torch.sort(expert_of_slot, stable=True)

    # offsets[e] = number of assignments with expert id < e (out-of-range ids fall after offsets[E]; offsets[0] = 0).
    expert_ids = torch.arange(num_experts + 1, device=device, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_expert, expert_ids)
    counts = offsets[1:] - offsets[:-1]

    # tiles_e = ceil(count_e / B); tile t belongs to the expert e with tile_end[e-1] <= t < tile_end[e].
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, dim=0)
    max_tiles = max_row_tiles(num_assignments, num_experts, block_m)
    tile_ids = torch.arange(max_tiles, device=device, dtype=torch.int64)
    tile_expert = torch.searchsorted(tile_end, tile_ids, right=True)  # == E past the last real tile
    expert_clamped = tile_expert.clamp(max=num_experts - 1)
    first_tile_of_expert = tile_end[expert_clamped] - tiles_per_expert[expert_clamped]
    # first row of tile t = offsets[e] + (t - first tile of e) * B
    tile_row_start = offsets[expert_clamped] + (tile_ids - first_tile_of_expert) * block_m

    return ExpertRouting(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        block_m=block_m,
        sorted_slot=perm.to(torch.int32),
        sorted_token=torch.div(perm, top_k, rounding_mode="floor").to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
        tile_expert=tile_expert.to(torch.int32),
        tile_row_start=tile_row_start.to(torch.int32),
        position=(torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=device))
                  .to(torch.int32) if with_position else None),
    )


ROUTE_BLOCK = 256  # assignments per program of the count and scatter kernels (32 in the interpreter)
ROUTE_CHUNK = 32  # assignments per step inside a program: a CHUNK x BINS one-hot matrix
ROUTE_SCAN_BINS = 16  # bins per program of the scan kernel


@dataclass(frozen=True)
class SortedAssignments:
    """What :func:`sort_assignments` returns; every tensor int32 on the routing device unless said otherwise."""

    sorted_slot: torch.Tensor  # (S,) assignment s of each sorted row
    sorted_token: torch.Tensor  # (S,) its token s // K
    expert_offsets: torch.Tensor  # (E + 1,) expert e owns sorted rows [offsets[e], offsets[e+1])
    tile_expert: torch.Tensor | None  # (max_tiles,) or None (``block_m`` None)
    tile_row_start: torch.Tensor | None
    position: torch.Tensor | None  # (S,) the sorted row of assignment s (``with_position``)
    weight_sorted: torch.Tensor | None  # (S,) the routing weight in sorted order, 0 for a dropped id (``weights``)
    valid_sorted: torch.Tensor | None  # (S,) bool: whether the sorted row's id was in [0, E)


@triton.jit
def _route_bins(idx_ptr, offs, mask, num_experts, INVALID_TO_FIRST: tl.constexpr):
    """(bin, valid) of the assignments ``offs``: e + 1 for expert e, E + 1 for an id outside [0, E) (with
    INVALID_TO_FIRST it takes expert 0's bin instead); -1 for a masked lane (no bin)."""
    ids = tl.load(idx_ptr + offs, mask=mask, other=0)
    valid = (ids >= 0) & (ids < num_experts)
    if INVALID_TO_FIRST:
        bins = tl.where(valid, ids, 0).to(tl.int32) + 1
    else:
        bins = tl.where(valid, ids, num_experts).to(tl.int32) + 1
    return tl.where(mask, bins, -1), valid


@triton.jit
def _route_count_kernel(idx_ptr, counts_ptr, num_assignments, num_experts,
                        INVALID_TO_FIRST: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                        BINS: tl.constexpr):
    # counts[pid, bin]: how many of this block's assignments fall in each bin
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, BLOCK, CHUNK):
        offs = pid * BLOCK + start + tl.arange(0, CHUNK)
        b, _valid = _route_bins(idx_ptr, offs, offs < num_assignments, num_experts, INVALID_TO_FIRST)
        total += tl.sum((b[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * BINS + bins, total)


@triton.jit
def _route_scan_kernel(counts_ptr, base_ptr, total_ptr, num_blocks,
                       BINS: tl.constexpr, SCAN_BINS: tl.constexpr, ROWS: tl.constexpr):
    # for this program's bins: base[b, bin] = Σ_{b' < b} counts[b', bin] (exclusive scan over blocks), and the total
    bins = tl.program_id(0) * SCAN_BINS + tl.arange(0, SCAN_BINS)
    running = tl.zeros([SCAN_BINS], dtype=tl.int32)
    for r0 in range(0, num_blocks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        m = rows[:, None] < num_blocks
        c = tl.load(counts_ptr + rows[:, None] * BINS + bins[None, :], mask=m, other=0)
        tl.store(base_ptr + rows[:, None] * BINS + bins[None, :], tl.cumsum(c, axis=0) - c + running[None, :], mask=m)
        running += tl.sum(c, axis=0)
    tl.store(total_ptr + bins, running)


@triton.jit
def _route_scatter_kernel(idx_ptr, base_ptr, total_ptr, weight_ptr,
                          slot_ptr, token_ptr, offsets_ptr, tile_expert_ptr, tile_row_start_ptr,
                          position_ptr, weight_sorted_ptr, valid_sorted_ptr,
                          num_assignments, num_experts, top_k, num_blocks, max_tiles,
                          INVALID_TO_FIRST: tl.constexpr, WITH_POSITION: tl.constexpr, WITH_WEIGHTS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                          TILES: tl.constexpr):
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.load(total_ptr + bins)
    start = tl.cumsum(total, axis=0) - total  # first sorted row of each bin
    if pid == 0:  # offsets[e] = start of expert e's bin (e + 1), e = 0..E (offsets[E]: where the ids >= E begin)
        tl.store(offsets_ptr + bins - 1, start, mask=(bins >= 1) & (bins <= num_experts + 1))
    if pid < num_blocks:
        running = tl.load(base_ptr + pid * BINS + bins) + start
        for s0 in range(0, BLOCK, CHUNK):
            offs = pid * BLOCK + s0 + tl.arange(0, CHUNK)
            mask = offs < num_assignments
            b, valid = _route_bins(idx_ptr, offs, mask, num_experts, INVALID_TO_FIRST)
            onehot = (b[:, None] == bins[None, :]).to(tl.int32)
            # stable: an assignment's row is its bin's next free row plus the earlier same-bin lanes of this chunk
            pos = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + running[None, :]), axis=1)
            tl.store(slot_ptr + pos, offs, mask=mask)
            tl.store(token_ptr + pos, offs // top_k, mask=mask)
            if WITH_POSITION:
                tl.store(position_ptr + offs, pos, mask=mask)
            if WITH_WEIGHTS:
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
                w = tl.where(valid, w, tl.zeros_like(w))
                tl.store(weight_sorted_ptr + pos, w, mask=mask)
                tl.store(valid_sorted_ptr + pos, valid.to(tl.int8), mask=mask)
            running += tl.sum(onehot, axis=0)
    if pid * TILES < max_tiles:  # this program's share of the row-tile map
        is_expert = (bins >= 1) & (bins <= num_experts)
        tiles = tl.where(is_expert, (total + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end = tl.cumsum(tiles, axis=0)
        tile_first = tile_end - tiles
        row_base = start - tile_first * BLOCK_M  # tile t of an expert starts at sorted row row_base + t * BLOCK_M
        t = pid * TILES + tl.arange(0, TILES)
        own = ((tile_first[None, :] <= t[:, None]) & (t[:, None] < tile_end[None, :])).to(tl.int32)
        found = tl.sum(own, axis=1) > 0  # tiles past the last real one belong to no expert
        expert = tl.where(found, tl.sum(own * bins[None, :], axis=1) - 1, num_experts)
        row_start = tl.where(found, tl.sum(own * row_base[None, :], axis=1) + t * BLOCK_M, 0)
        tl.store(tile_expert_ptr + t, expert, mask=t < max_tiles)
        tl.store(tile_row_start_ptr + t, row_start, mask=t < max_tiles)


def sort_assignments(top_k_index: torch.Tensor, num_experts: int, *, block_m: int | None = None,
                     invalid_to_first: bool = False, with_position: bool = False,
                     weights: torch.Tensor | None = None) -> SortedAssignments:
    """The stable counting sort of the module docstring: three Triton launches, no host sync.

    ``block_m``: also build the row-tile map for tiles of that many rows (None: no map). ``invalid_to_first``: an id
    outside [0, E) sorts into expert 0's rows instead of outside every expert's (the grouped-GEMM engine, whose
    ``torch._grouped_mm`` groups start at row 0, then gives it weight 0). ``with_position``: also the inverse map.
    ``weights`` (T, K): also the routing weights in sorted order, 0 for a dropped id, and whether
    each sorted row's id is in range. Needs CUDA or Triton's interpreter and at least one assignment."""
    num_tokens, top_k = top_k_index.shape
    num_assignments = num_tokens * top_k
    device = top_k_index.device
    if num_assignments == 0:
        raise ValueError("sort_assignments needs at least one assignment")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if weights is not None and weights.shape != top_k_index.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must match top_k_index {tuple(top_k_index.shape)}")
    idx = top_k_index.reshape(-1)
    interp = running_in_interpreter()
    block, chunk = (32, 16) if interp else (ROUTE_BLOCK, ROUTE_CHUNK)
    bins = max(ROUTE_SCAN_BINS, next_power_of_2(num_experts + 2))
    num_blocks = cdiv(num_assignments, block)
    counts = torch.empty(num_blocks, bins, device=device, dtype=torch.int32)
    base = torch.empty_like(counts)
    total = torch.empty(bins, device=device, dtype=torch.int32)
    slot = torch.empty(num_assignments, device=device, dtype=torch.int32)
    token = torch.empty_like(slot)
    offsets = torch.empty(num_experts + 1, device=device, dtype=torch.int32)
    max_tiles = max_row_tiles(num_assignments, num_experts, block_m) if block_m is not None else 0
    tile_expert = torch.empty(max_tiles, device=device, dtype=torch.int32) if block_m is not None else None
    tile_row_start = torch.empty_like(tile_expert) if block_m is not None else None
    position = torch.empty_like(slot) if with_position else None
    weight_sorted = valid_sorted = None
    if weights is not None:
        weight_sorted = torch.empty(num_assignments, device=device, dtype=weights.dtype)
        valid_sorted = torch.empty(num_assignments, device=device, dtype=torch.int8)
    warps = 4
    _route_count_kernel[(num_blocks,)](idx, counts, num_assignments, num_experts,
                                       INVALID_TO_FIRST=invalid_to_first, BLOCK=block, CHUNK=chunk, BINS=bins,
                                       num_warps=warps)
    _route_scan_kernel[(bins // ROUTE_SCAN_BINS,)](counts, base, total, num_blocks, BINS=bins,
                                                   SCAN_BINS=ROUTE_SCAN_BINS, ROWS=16 if interp else 64,
                                                   num_warps=warps)
    tiles_per_program = 16 if interp else 64
    unused = slot  # a placeholder for pointers a launch leaves unused
    _route_scatter_kernel[(max(num_blocks, cdiv(max_tiles, tiles_per_program)),)](
        idx, base, total, weights.reshape(-1) if weights is not None else unused,
        slot, token, offsets,
        tile_expert if tile_expert is not None else unused, tile_row_start if tile_row_start is not None else unused,
        position if position is not None else unused,
        weight_sorted if weight_sorted is not None else unused,
        valid_sorted if valid_sorted is not None else unused,
        num_assignments, num_experts, top_k, num_blocks, max_tiles,
        INVALID_TO_FIRST=invalid_to_first, WITH_POSITION=with_position, WITH_WEIGHTS=weights is not None,
        BLOCK_M=block_m or 1, BLOCK=block, CHUNK=chunk, BINS=bins, TILES=tiles_per_program, num_warps=warps,
    )
    return SortedAssignments(
        sorted_slot=slot, sorted_token=token, expert_offsets=offsets, tile_expert=tile_expert,
        tile_row_start=tile_row_start, position=position, weight_sorted=weight_sorted,
        valid_sorted=valid_sorted.view(torch.bool) if valid_sorted is not None else None,
    )


def route_experts_reference(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> dict:
    """Plain-Python routing (host loops) with the same contract, for tests.

    Returns the in-range part of ``sorted_slot`` / ``sorted_token`` (rows ``offsets[0]:offsets[E]``),
    the offsets and the list of real tiles ``(expert, first_row)``.
    """
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1).tolist()
    sorted_slot, offsets, tiles = [], [0], []  # out-of-range ids (negative too) sort after the last expert
    for expert in range(num_experts):
        rows = [s for s, e in enumerate(flat) if e == expert]
        start = len(sorted_slot)
        sorted_slot.extend(rows)
        offsets.append(start + len(rows))
        tiles.extend((expert, row) for row in range(start, start + len(rows), block_m))
    return {
        "sorted_slot": sorted_slot,
        "sorted_token": [s // top_k for s in sorted_slot],
        "expert_offsets": offsets,
        "tiles": tiles,
    }


def free_saved(tensor: torch.Tensor) -> None:
    """Release a saved intermediate's memory inside backward, after its last use, while autograd still holds the
    tensor until backward returns: its storage is resized to zero bytes. Saved-tensor accounting
    (:func:`lora_lab.memory.saved_bytes_excluding`) still counts it, as it was saved. Only for a tensor that owns
    its storage alone (a fresh allocation, not a view); anything else is left as it is."""
    storage = tensor.untyped_storage()
    alone = storage.nbytes() == tensor.numel() * tensor.element_size()
    if tensor._base is None and tensor.storage_offset() == 0 and alone:
        storage.resize_(0)


def refuse_second_backward(ctx, what: str) -> None:
    """Backward frees saved buffers (:func:`free_saved`): a second backward through the same graph
    (``retain_graph=True``) is refused by name instead of reading freed memory."""
    if getattr(ctx, "backward_ran", False):
        raise RuntimeError(f"{what} frees its saved [g | u] buffer in backward, so it cannot run backward twice "
                           "(retain_graph=True); run the layer forward again")
    ctx.backward_ran = True
