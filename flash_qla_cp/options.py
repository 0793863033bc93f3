"""KernelOptions: the choices between kernel variants a call may override, passed explicitly.

The defaults are the fastest variants measured on an H200 (docs/kernels.md); the other values
exist for comparisons in one process (benchmarks, tools) and for falling back when a variant is
suspected. An instance is frozen and hashable, so kernel plans are cached per options.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSED_WALK_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class KernelOptions:
    """Options of the TileLang backend (the torch backend ignores them).

    fused_walk: the backward's dh walk and grad kernel as one fused walk per (sequence or
        partition, v-head): 'auto' where those walks about fill the GPU (one block each),
        'on' / 'off' always / never. Head dims past 128 never take it (its state does not fit).
    four_warpgroups: the forward carries a whole 128-wide state per block over four
        warpgroups where that grid fills the GPU; False keeps the three-warpgroup forward.
    tilelang_backward: False runs the torch backward (the hand-written chunked walks) after a
        TileLang forward, e.g. to rule the backward kernels out when chasing a difference.
    """

    fused_walk: str = "auto"
    four_warpgroups: bool = True
    tilelang_backward: bool = True

    def __post_init__(self):
        if self.fused_walk not in FUSED_WALK_MODES:
            raise ValueError(f"KernelOptions: fused_walk must be one of {FUSED_WALK_MODES}, got {self.fused_walk!r}")
        for name in ("four_warpgroups", "tilelang_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelOptions: {name} must be a bool, got {getattr(self, name)!r}")


DEFAULT_OPTIONS = KernelOptions()
