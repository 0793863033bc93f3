"""cu_seqlens read back to the host without waiting for the GPU to drain first, and once per tensor.

The layer needs the sequence offsets on the host (its input check, the op's plans). A plain
`.cpu()` waits for every kernel queued before it, and the layer's projection is then launched
onto an idle GPU. Here the copy is queued into pinned memory with an event behind it; the layer
launches the projection, which does not need the offsets, and only then waits for the event, so
the GPU runs the projection while the host checks the offsets and plans the rest of the call.

A model passes one cu_seqlens tensor to every layer of a step (and a benchmark to every call):
its copy is kept for the same tensor object until the tensor changes (its version counter moves
with every in-place torch op on it or on a view of it), so only the first layer waits for the
GPU and the others queue their work behind it without a pause. Not kept: inference-mode tensors
(they count no versions). A write the version counter does not see (a kernel or library writing
the tensor's memory itself) is not seen: such a caller passes a new tensor.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

# tensors whose copies are kept: a step's offsets, with room for a few alternating batches
_KEPT = 4
# (tensor id, version) -> (weak reference to the tensor, its read-back), oldest first
_recent: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


class OffsetsReadBack:
    """A host copy of `cu_seqlens` on its way; `result()` waits for it (once) and returns it."""

    def __init__(self, cu_seqlens: torch.Tensor):
        self._event = None
        if cu_seqlens.device.type == "cuda":
            self._host = torch.empty(cu_seqlens.shape, dtype=cu_seqlens.dtype, pin_memory=True)
            self._host.copy_(cu_seqlens, non_blocking=True)
            self._event = torch.cuda.Event()
            # behind the copy: on the stream that runs it (the current one of cu_seqlens' device)
            self._event.record(torch.cuda.current_stream(cu_seqlens.device))
        else:
            self._host = cu_seqlens.cpu().clone()  # (kept: not the caller's tensor, which may change)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor) -> "OffsetsReadBack":
        """The read-back of `cu_seqlens`: the kept one when this tensor, unchanged, was read back
        before (its copy shared: callers only read it), else a new one, then kept."""
        if cu_seqlens.is_inference():
            return cls(cu_seqlens)
        key = (id(cu_seqlens), cu_seqlens._version)
        with _lock:
            kept = _recent.get(key)
            if kept is not None and kept[0]() is cu_seqlens:
                _recent.move_to_end(key)
                return kept[1]
        read_back = cls(cu_seqlens)
        with _lock:
            _recent[key] = (weakref.ref(cu_seqlens), read_back)
            while len(_recent) > _KEPT:
                _recent.popitem(last=False)
        return read_back

    def arrived(self) -> bool:
        """Whether `result()` would return without waiting."""
        return self._event is None or self._event.query()

    def result(self) -> torch.Tensor:
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        return self._host

