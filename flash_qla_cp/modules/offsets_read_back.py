"""cu_seqlens read back to the host without waiting for the GPU to drain first.

The layer needs the sequence offsets on the host (its input check, the op's plans). A plain
`.cpu()` waits for every kernel queued before it, and the layer's projection is then launched
onto an idle GPU. Here the copy is queued into pinned memory with an event behind it; the layer
launches the projection, which does not need the offsets, and only then waits for the event, so
the GPU runs the projection while the host checks the offsets and plans the rest of the call.
"""

from __future__ import annotations

import torch


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
            self._host = cu_seqlens.cpu()

    def arrived(self) -> bool:
        """Whether `result()` would return without waiting."""
        return self._event is None or self._event.query()

    def result(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
