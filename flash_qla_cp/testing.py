"""Random GDN inputs and error measures shared by the tests, GPU checks and benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_gdn_inputs(
    batch: int = 1,
    seq_len: int = 128,
    num_heads: int = 2,
    num_v_heads: int = 4,
    head_k_dim: int = 32,
    head_v_dim: int = 32,
    dtype: torch.dtype = torch.float64,
    device="cpu",
    strong_decay_heads: int = 1,
    zero_gate_heads: int = 1,
    generator: torch.Generator | None = None,
):
    """q, k l2-normalised; g = -exp(A) softplus(x); the first heads decay strongly, the last have g = 0.

    Returns dict(q, k, v, g, beta) with q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV].
    g and beta are fp32 for half dtypes (as a model produces them), else in `dtype`.
    """
    gen = generator
    B, T, H, HV, K, V = batch, seq_len, num_heads, num_v_heads, head_k_dim, head_v_dim
    gate_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, HV, V)
    log_a = torch.rand(HV, generator=gen, dtype=torch.float64) * 1.5 - 1.0
    log_a[:strong_decay_heads] += 2.5  # exp(A) ~ 5-15: the history fades within a few tokens
    g = -log_a.exp() * F.softplus(randn(B, T, HV))
    if zero_gate_heads:
        g[..., HV - zero_gate_heads :] = 0.0  # no decay at all: the exact, long-memory case
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64).sigmoid()
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(gate_dtype), beta=beta.to(gate_dtype))
    return {name: t.to(device) for name, t in out.items()}


def random_cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """cu_seqlens [N + 1] int32 from a list of sequence lengths."""
    edges = [0]
    for n in lengths:
        edges.append(edges[-1] + int(n))
    return torch.tensor(edges, dtype=torch.int32, device=device)


def chunk_local_cumsum(g: torch.Tensor, cu, chunk: int = 64) -> torch.Tensor:
    """The prepare kernel's G: g [1, T, HV] summed inside each 64-token chunk of each sequence
    of the host offsets `cu` (what the split's warm-up tables read)."""
    out = torch.empty_like(g)
    for a, b in zip(cu, cu[1:]):
        for c in range(a, b, chunk):
            out[:, c : min(c + chunk, b)] = g[:, c : min(c + chunk, b)].cumsum(1)
    return out


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere gives inf (never passes)."""
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def outputs_and_grads(fn, x: dict, initial_state, do, dht, cast=None, **kwargs) -> list:
    """[o, final state, dq, dk, dv, dg, dbeta] (+ [dh0] with an initial state) of
    fn(**x, initial_state=..., output_final_state=True, **kwargs) for the loss <o, do> + <final, dht>,
    on fresh leaves (each input first passed through `cast`, e.g. to float64); gradients of inputs
    nothing depends on (no tokens) are zeros. `fn`: the op or a reference with its signature."""
    cast = cast or (lambda t: t)
    names = ("q", "k", "v", "g", "beta")
    leaves = [cast(x[n]).detach().clone().requires_grad_(True) for n in names]
    if initial_state is not None:
        leaves.append(cast(initial_state).detach().clone().requires_grad_(True))
    o, final = fn(**dict(zip(names, leaves)), initial_state=leaves[5] if initial_state is not None else None,
                  output_final_state=True, **kwargs)
    loss = (o.double() * do.double()).sum() + (final.double() * dht.double()).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    return [o, final, *(torch.zeros_like(t) if d is None else d for d, t in zip(grads, leaves))]


def cuda_graph_replay(fn, warmup: int = 3):
    """A callable replaying one call of `fn` captured in a CUDA graph (what fn's call returned
    during the capture is `.outputs`), or the reason it cannot be captured (e.g. a host sync
    inside the call). Warm-up on a side stream first, as torch asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = fn()
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        torch.cuda.synchronize()
        return f"not capturable: {exc!r}"[:300]
    return _Replay(graph, outputs)


class _Replay:
    """graph.replay as a callable that keeps the graph and the captured call's outputs."""

    def __init__(self, graph, outputs):
        self.graph, self.outputs = graph, outputs

    def __call__(self):
        self.graph.replay()
