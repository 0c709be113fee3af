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

Expert ids outside ``[0, E)`` (transformers' expert-parallel sentinels) sort outside every
expert's block and are simply dropped, as transformers' ``grouped_mm`` path drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def route_experts(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> ExpertRouting:
    """Sort the assignments by expert and build the row-tile map, all with device ops (no host sync)."""
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be 2-D (tokens, top_k), got shape {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    num_tokens, top_k = top_k_index.shape
    device = top_k_index.device
    num_assignments = num_tokens * top_k

    # e_s for s = t*K + k, then a stable sort so rows of one expert keep token order (deterministic).
    expert_of_slot = top_k_index.reshape(-1).to(torch.int64)
    sorted_expert, perm = torch.sort(expert_of_slot, stable=True)

    # offsets[e] = number of assignments with expert id < e (out-of-range ids fall outside [offsets[0], offsets[E])).
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
    )


def route_experts_reference(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> dict:
    """Plain-Python routing (host loops) with the same contract, for tests.

    Returns the in-range part of ``sorted_slot`` / ``sorted_token`` (rows ``offsets[0]:offsets[E]``),
    the offsets and the list of real tiles ``(expert, first_row)``.
    """
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1).tolist()
    below = sum(1 for e in flat if e < 0)  # negative ids sort before expert 0
    sorted_slot, offsets, tiles = [], [below], []
    for expert in range(num_experts):
        rows = [s for s, e in enumerate(flat) if e == expert]
        start = below + len(sorted_slot)
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
