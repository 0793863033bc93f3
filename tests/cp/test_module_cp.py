"""The GatedDeltaNet module under 2-rank CP (gloo; inter and dual) equals the single-process module:
the fused layer steps around the CP op, the conv halo exchanged in them (forward and backward)."""

import torch
import torch.distributed as dist

from cp_harness import run_workers
from flash_qla_cp.modules.gated_deltanet import GatedDeltaNet
from flash_qla_cp.parallel import CPContext
from flash_qla_cp.testing import random_cu_seqlens, rel_err

# crossing the rank boundary at 160 tokens, one starting 2 tokens before it (partial conv halo)
LENGTHS = [50, 108, 80, 2 + 78 + 2]


def _reaches(fn, name, seen=None) -> bool:
    """Whether the autograd graph below `fn` has a node called `name`."""
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return False
    seen.add(fn)
    return type(fn).__name__ == name or any(_reaches(nxt, name, seen) for nxt, _ in fn.next_functions)


def _module_worker(rank, world):
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, conv_size=4, backend="torch").double()
    cu = random_cu_seqlens(LENGTHS)
    T = sum(LENGTHS)
    x = torch.randn(1, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dout = torch.randn(1, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    xr = x.clone().requires_grad_(True)
    (layer(xr, cu_seqlens=cu) * dout).sum().backward()
    ref_out = layer(x, cu_seqlens=cu).detach()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    ref_dx = xr.grad
    layer.zero_grad()

    errs = {}
    for tag, intra in (("inter", "off"), ("dual", 2)):
        layer.zero_grad()
        cp = CPContext.build(cu, intra_cp=intra, intra_exact=True)
        xl = cp.local_slice(x).clone().requires_grad_(True)
        out = layer(xl, cu_seqlens=cu, cp_context=cp)
        assert _reaches(out.grad_fn, "LayerInputsBackward")  # the fused steps around the CP op
        (out * cp.local_slice(dout)).sum().backward()
        errs[tag + " out"] = rel_err(out, cp.local_slice(ref_out))
        errs[tag + " dx"] = rel_err(xl.grad, cp.local_slice(ref_dx))
        for n, p in layer.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)  # parameters are replicated: the data-parallel sum of the ranks' parts
            errs[f"{tag} d{n}"] = rel_err(grad, ref_grads[n])
    return errs


def test_module_under_cp_matches_single_process():
    for rank, errs in enumerate(run_workers(2, _module_worker)):
        bad = {k: v for k, v in errs.items() if not v < 1e-10}
        assert not bad, f"rank {rank}: {bad}"
