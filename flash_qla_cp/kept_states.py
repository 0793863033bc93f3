"""What a compiled forward keeps for its backward: the TileLang forward's chunk states.

A torch.library custom op returns tensors of a fixed schema, while the kept chunk states are a
varying set (their number and sizes follow the call's split and, for packed sequences, the
sequences' lengths). So the forward custom op files them here and returns a handle: a one-element
CPU int64 tensor holding the entry's number, which autograd saves for the backward like any
activation. The backward custom op takes the entry out (once).

An entry lives no longer than its handle: when the autograd graph that saved the handle is freed
without a backward, the entry goes with it. Without an entry (a second backward of a retained
graph, or a forward that kept nothing) the backward runs the forward again.

Filing and taking are host work on every call, which a replayed CUDA graph would skip: the custom
ops that do it carry `HOST_WORK_TAGS`, which keeps them out of the CUDA graphs torch.compile
captures (mode="reduce-overhead").
"""

from __future__ import annotations

import itertools
import weakref

import torch

# (the tag exists from torch 2.8 on; reading cu_seqlens back already kept the ops out of captures)
HOST_WORK_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

_entries: dict[int, object] = {}
_numbers = itertools.count()
_NOTHING = -1


def file(entry) -> torch.Tensor:
    """Files entry; returns its handle."""
    number = next(_numbers)
    _entries[number] = entry
    handle = torch.tensor([number], dtype=torch.int64)
    weakref.finalize(handle, _entries.pop, number, None)
    return handle


def nothing() -> torch.Tensor:
    """The handle of a forward that kept nothing."""
    return torch.tensor([_NOTHING], dtype=torch.int64)


def fake_handle() -> torch.Tensor:
    """A handle's shape for a custom op's fake implementation."""
    return torch.empty(1, dtype=torch.int64, device="cpu")


def take(handle: torch.Tensor):
    """The entry handle refers to, removed (None if there is none)."""
    return _entries.pop(int(handle.item()), None)


def filed() -> int:
    """How many entries are filed (for tests: none should outlive its graph)."""
    return len(_entries)
