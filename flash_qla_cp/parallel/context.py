"""CPContext: where this rank's tokens sit in the packed global batch, built once per batch.

The packed stream (B = 1, global cu_seqlens) is cut into `world` equal contiguous slices.
Everything here is derived from cu_seqlens alone, so every rank can reason about every other
rank (who passes a state through, who owns which final state) without communicating.
Validation is collective: each rank reports its verdict in one small all_gather, and every
rank raises the same error, so a bad batch never leaves some ranks waiting in a collective.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..validation import is_intra_option


class CPError(ValueError):
    """Raised identically on every rank of the CP group."""


def comm_device(group) -> torch.device:
    """NCCL moves CUDA tensors only; gloo (and no group) uses the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class RankLayout:
    """Segments of one rank: (local_start, local_end, global_seq) for each non-empty piece."""

    segments: tuple
    first_continues: bool  # segment 0 began on an earlier rank
    last_continues: bool  # the last segment goes on to a later rank
    owned: range  # global sequences whose final state is produced on this rank

    @property
    def passes_through(self) -> bool:
        """One sequence covers the whole rank and goes on: S_out depends on S_in through M."""
        return self.first_continues and self.last_continues and len(self.segments) == 1


def _layout(edges, start: int, end: int, world_end: int) -> RankLayout:
    segs = []
    for n in range(len(edges) - 1):
        a, b = max(edges[n], start), min(edges[n + 1], end)
        if a < b:
            segs.append((a - start, b - start, n))
    first = segs[0][2]
    last = segs[-1][2]
    # final state of sequence n is produced where its last token lies; empty ones go by position
    def owner_pos(n):
        return edges[n + 1] - 1 if edges[n + 1] > edges[n] else min(edges[n], world_end - 1)

    owned = [n for n in range(len(edges) - 1) if start <= owner_pos(n) < end]
    owned_range = range(owned[0], owned[-1] + 1) if owned else range(0)
    return RankLayout(tuple(segs), edges[first] < start, edges[last + 1] > end, owned_range)


@dataclass
class CPContext:
    """Per-batch CP plan. Build with `CPContext.build`; pass as `cp_context=` to the op / module.

    intra_cp: 'auto', 'off', or an int number of partitions per sequence for the intra-card split
    inside each rank (as the op's `intra_cp`). intra_exact, intra_threshold, intra_window: the torch
    backend's split engine (`parallel/intra.py`): exact (the default), or the decay shortcut with its
    threshold and window.
    """

    group: object
    rank: int
    world: int
    cu_seqlens_global: list
    seq_len_global: int
    layouts: list = field(repr=False)
    intra_cp: object = "off"
    intra_exact: bool = True
    intra_threshold: float = -10.0
    intra_window: int = 2

    # -- derived views of this rank ------------------------------------------------------
    @property
    def local_len(self) -> int:
        return self.seq_len_global // self.world

    @property
    def token_range(self) -> tuple:
        return self.rank * self.local_len, (self.rank + 1) * self.local_len

    @property
    def layout(self) -> RankLayout:
        return self.layouts[self.rank]

    @property
    def first_continues(self) -> bool:
        return self.layout.first_continues

    @property
    def last_continues(self) -> bool:
        return self.layout.last_continues

    @property
    def segment_seq_ids(self) -> list:
        """Global sequence index of every local segment."""
        return [n for _, _, n in self.layout.segments]

    @property
    def num_seqs_global(self) -> int:
        return len(self.cu_seqlens_global) - 1

    def local_cu_seqlens(self, device=None) -> torch.Tensor:
        edges = [0] + [b for _, b, _ in self.layout.segments]
        return torch.tensor(edges, dtype=torch.int32, device=device)

    @property
    def carries_transition(self) -> bool:
        """Some rank passes a state through, so M must travel with h in the all_gather."""
        return any(lay.passes_through for lay in self.layouts)

    def local_slice(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous piece of a global [B, T_global, ...] tensor."""
        a, b = self.token_range
        return x.narrow(dim, a, b - a)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def build(cls, cu_seqlens_global, group=None, seq_len_global=None, intra_cp="off",
              intra_exact=True, intra_threshold=-10.0, intra_window=2) -> "CPContext":
        """Plan this batch. group=None: the default group if torch.distributed is initialised,
        else a single process (world 1; intra-card splitting only)."""
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        return cls._make(cu_seqlens_global, group, seq_len_global, intra_cp, intra_exact, intra_threshold,
                         intra_window)

    @classmethod
    def single(cls, cu_seqlens, intra_cp="auto", intra_exact=True, intra_threshold=-10.0, intra_window=2):
        """One process, no collectives: intra-card CP only (even when torch.distributed is up)."""
        return cls._make(cu_seqlens, None, None, intra_cp, intra_exact, intra_threshold, intra_window)

    @classmethod
    def _make(cls, cu_seqlens_global, group, seq_len_global, intra_cp, intra_exact, intra_threshold, intra_window):
        rank = dist.get_rank(group) if group is not None else 0
        world = dist.get_world_size(group) if group is not None else 1

        problem, edges, T = None, [], 0
        try:
            edges, T = _check_local(cu_seqlens_global, seq_len_global, world)
        except CPError as exc:
            problem = str(exc)
        if group is not None:
            _agree(edges, T, problem, rank, world, group)
        elif problem:
            raise CPError(problem)
        if not is_intra_option(intra_cp):
            raise CPError(f"intra_cp must be 'auto', 'off' or a positive int, got {intra_cp!r}")
        L = T // world
        layouts = [_layout(edges, r * L, (r + 1) * L, T) for r in range(world)]
        return cls(group, rank, world, edges, T, layouts, intra_cp, intra_exact, float(intra_threshold),
                   int(intra_window))


def _check_local(cu, seq_len_global, world):
    """Plain checks on this rank's copy of cu_seqlens; raises CPError."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        raise CPError("cu_seqlens_global must be a 1-D int32/int64 tensor [N + 1]")
    edges = [int(e) for e in cu.tolist()]
    if edges[0] != 0 or any(b < a for a, b in zip(edges, edges[1:])):
        raise CPError(f"cu_seqlens_global must start at 0 and be non-decreasing, got {edges[:8]}...")
    T = edges[-1]
    if seq_len_global is not None and int(seq_len_global) != T:
        raise CPError(f"seq_len_global={seq_len_global} but cu_seqlens_global ends at {T}")
    if T == 0 or T % world:
        raise CPError(f"the global token count {T} must be a positive multiple of the CP world size {world} "
                      f"(pad the packed batch; uneven splits are not supported)")
    return edges, T


def agree(group, world, problem, signature, what: str, differs: str):
    """One all_gather of (failed, *signature) so that every rank reaches the same verdict: a
    problem found on any rank, or signatures (ints that must be equal on every rank) that
    differ, raise the same CPError on every rank instead of leaving the others waiting in the
    next collective. `what` names the call, `differs` what a differing signature means."""
    mine = torch.tensor([0 if problem is None else 1, *signature], dtype=torch.int64, device=comm_device(group))
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    rows = [t.cpu().tolist() for t in got]
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        detail = f" (here: {problem})" if problem else ""
        raise CPError(f"{what}: invalid input on rank(s) {bad}{detail}")
    if any(row[1:] != rows[0][1:] for row in rows):
        raise CPError(f"{what}: {differs} (per rank: {[tuple(row[1:]) for row in rows]})")


def _agree(edges, T, problem, rank, world, group):
    """CPContext.build's verdict: the same valid cu_seqlens_global on every rank."""
    crc = zlib.crc32(",".join(map(str, edges)).encode()) if edges else 0  # (no numpy: torch does not need it)
    agree(group, world, problem, [len(edges), T, crc], "CPContext.build",
          "cu_seqlens_global differs across ranks (length, T, crc32); every rank must pass the same global cu_seqlens")
