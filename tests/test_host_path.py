"""The TileLang backend's host code on the CPU, with every kernel launch recorded instead of run.

GPU kernels cannot run here, but the Python around them can: which kernels one call launches,
that each gets as many arguments as its PrimFunc takes with the rank and dtype of each buffer,
and how many torch fill launches a call adds (each is a launch on the GPU: the host time that
made small eager calls host-bound on the H200, benchmarks/NOTES.md).
"""

from unittest import mock

import pytest
import torch

pytest.importorskip("tilelang")

from flash_qla_cp.kernels import tilelang_bwd_impl, tilelang_common, tilelang_fwd, tilelang_split  # noqa: E402

SMS = 132  # an H200


class Launches:
    """Stands in for compile_kernel: each launch is recorded as (factory, params, args)."""

    def __init__(self):
        self.calls = []

    def compile_kernel(self, factory, **params):
        return lambda *args: self.calls.append((factory, params, args))

    def names(self):
        return [factory.__name__ for factory, _, _ in self.calls]


def run_recorded(fn):
    """(fn's result, Launches, number of torch fills) for the second of two calls of fn with
    kernels recorded (the first builds the split plan's cached index tensors)."""
    launches = Launches()
    with mock.patch.object(tilelang_fwd, "compile_kernel", launches.compile_kernel), \
            mock.patch.object(tilelang_bwd_impl, "compile_kernel", launches.compile_kernel), \
            mock.patch.object(tilelang_split, "compile_kernel", launches.compile_kernel), \
            mock.patch.object(tilelang_common, "sm_count", lambda device: SMS):
        fn()
        launches.calls.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn()
    fills = sum(e.count for e in prof.key_averages() if e.key == "aten::fill_")  # zeros / zero_ end here
    return out, launches, fills


def inputs(T, H, HV, D=128, B=1):
    q = torch.zeros(B, T, H, D, dtype=torch.bfloat16)
    v = torch.zeros(B, T, HV, D, dtype=torch.bfloat16)
    return q, q.clone(), v, torch.zeros(B, T, HV), torch.zeros(B, T, HV)


def forward(q, k, v, g, beta, final, keep, cu=None, h0=None):
    return tilelang_fwd.tilelang_chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, None, h0, final, cu, partitions="auto",
        cu_seqlens_host=None if cu is None else cu.tolist(), save_states=keep)


def fwd_bwd(q, k, v, g, beta, cu=None, h0=None, with_dht=False):
    """A training step's two halves: the forward keeping its states, then the backward (with a
    final-state gradient when with_dht)."""
    do = torch.zeros_like(v)

    def call():
        _, ht, saved = forward(q, k, v, g, beta, with_dht, True, cu=cu, h0=h0)
        dht = torch.zeros_like(ht) if with_dht else None
        return tilelang_bwd_impl.tilelang_chunk_gated_delta_rule_bwd(do, dht, q, k, v, g, beta, None, h0, cu, saved)

    return call


VARLEN_CU = torch.tensor([0, 5000, 5003, 12004, 16004, 20101], dtype=torch.int32)


def test_split_forward_launches_five_kernels_and_fills_nothing():
    """TP8 1x32k (2 qk-heads, 4 v-heads, one sequence): cut into partitions, so the forward is
    prepare, decay tables, summaries, scan, walk. Without an initial state the scan starts from
    zero itself (use_s0 off): no fill."""
    q, k, v, g, beta = inputs(32768, 2, 4)
    (o, ht, saved), launches, fills = run_recorded(lambda: forward(q, k, v, g, beta, True, False))
    assert saved["split"] is not None
    assert launches.names() == ["build_prepare_kernel", "build_decay_tables_kernel", "build_state_summary_kernel",
                                "build_partition_scan_kernel", "build_fused_fwd_ws4_kernel"]
    assert launches.calls[3][1]["use_s0"] is False
    assert fills == 0
    assert o.shape == v.shape and ht.shape == (1, 4, 128, 128)


def test_wide_heads_stay_whole():
    """K = V = 256: the split's partition scan would not fit in shared memory, so 'auto' leaves
    a long sequence whole (prepare + walk) and an explicit partition count is refused."""
    q, k, v, g, beta = inputs(32768, 2, 4, D=256)
    (_, _, saved), launches, _ = run_recorded(lambda: forward(q, k, v, g, beta, True, False))
    assert launches.names() == ["build_prepare_kernel", "build_fused_fwd_kernel"]
    assert "split" not in saved
    with pytest.raises(ValueError, match="head dims <= 128"):
        tilelang_fwd.tilelang_chunk_gated_delta_rule_fwd(q, k, v, g, beta, partitions=4)


def test_wide_heads_backward_runs_the_walks_then_torch_chunk_grads():
    """K = V = 256 with WIDE_GRADS = "torch": the two walks in TileLang (the dh walk at block_v
    32, where it fits in shared memory), then `chunk_grads_from_states` in place of the grad
    kernel (which would not fit)."""
    q, k, v, g, beta = inputs(5000, 2, 4, D=256)
    calls = []

    def chunk_grads(qf, kf, dof, vres, dvn, gcum, b32, h_st, dh_st, cu, ctab, scale):
        calls.append((h_st.shape, dh_st.shape, ctab.shape))
        return torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(gcum), torch.zeros_like(gcum)

    with mock.patch.object(tilelang_bwd_impl, "chunk_grads_from_states", chunk_grads), \
            mock.patch.object(tilelang_bwd_impl, "WIDE_GRADS", "torch"):
        grads, launches, _ = run_recorded(fwd_bwd(q, k, v, g, beta, h0=torch.zeros(1, 4, 256, 256)))
    assert launches.names() == ["build_prepare_kernel", "build_fused_fwd_kernel", "build_bwd_h_kernel",
                                "build_bwd_dh_kernel"]
    assert launches.calls[2][1]["block_v"] == launches.calls[3][1]["block_v"] == 32
    assert calls[-1] == ((79, 4, 256, 256), (79, 4, 256, 256), (79, 2))  # ceil(5000 / 64) chunks (run_recorded calls twice)
    assert_launches_match_signatures(launches)
    assert [t.shape for t in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]


@pytest.mark.parametrize("H", [2, 4])
def test_wide_heads_backward_with_the_sliced_grad_kernel(H):
    """K = V = 256 with WIDE_GRADS = "kernel" (the default): the two walks, then the V-sliced
    grad kernel, and (GVA) the v-head sum of its dq / dk parts."""
    q, k, v, g, beta = inputs(5000, H, 4, D=256)
    with mock.patch.object(tilelang_bwd_impl, "WIDE_GRADS", "kernel"), \
            mock.patch.object(tilelang_bwd_impl, "chunk_grads_from_states", None):  # must not be called
        grads, launches, _ = run_recorded(fwd_bwd(q, k, v, g, beta, h0=torch.zeros(1, 4, 256, 256)))
    names = ["build_prepare_kernel", "build_fused_fwd_kernel", "build_bwd_h_kernel", "build_bwd_dh_kernel",
             "build_bwd_grad_wide_kernel"]
    assert launches.names() == names + (["build_v_head_sum_kernel"] if H < 4 else [])
    assert_launches_match_signatures(launches)
    assert [t.shape for t in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]


def test_split_backward_reads_no_zero_filled_exit_gradients():
    """The split fwd+bwd: the backward adds the warm-up dh walk (starting from zero by
    construction), the reverse scan, the fused walk and the GVA sum of dq / dk."""
    q, k, v, g, beta = inputs(32768, 2, 4)
    grads, launches, fills = run_recorded(fwd_bwd(q, k, v, g, beta))
    assert launches.names()[5:] == ["build_bwd_dh_ws_kernel", "build_partition_scan_kernel",
                                    "build_bwd_fused_ws_kernel", "build_v_head_sum_kernel"]
    warm = launches.calls[5][1]
    assert warm["limit_chunks"] and not warm["use_dht"]
    assert launches.calls[6][1]["use_s0"] is False  # the reverse scan enters at zero too (no dht)
    assert fills == 0
    assert [t.shape for t in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]


def test_unsplit_varlen_call_needs_no_fill():
    """Several documents on 32 v-heads fill the GPU unsplit: no scan, and without an initial
    state or an exit gradient nothing is zero-filled (the kernels do not read them)."""
    _, launches, fills = run_recorded(fwd_bwd(*inputs(20101, 16, 32), cu=VARLEN_CU))
    assert launches.names() == ["build_prepare_kernel", "build_fused_fwd_ws4_kernel", "build_bwd_fused_ws_kernel",
                                "build_v_head_sum_kernel"]
    assert fills == 0


def assert_launches_match_signatures(launches):
    """Each recorded launch passes one argument per PrimFunc parameter, tensors of the buffer's
    rank and dtype: the plumbing between the host code and the kernels, checked without a GPU."""
    for factory, params, args in launches.calls:
        prim = factory(**params)
        assert len(args) == len(prim.params), factory.__name__
        for var, arg in zip(prim.params, args):
            buf = prim.buffer_map.get(var)
            if buf is None:
                continue
            assert torch.is_tensor(arg), (factory.__name__, var.name)
            assert arg.dim() == len(buf.shape), (factory.__name__, buf.name, arg.shape)
            assert str(arg.dtype).replace("torch.", "") == str(buf.dtype), (factory.__name__, buf.name, arg.dtype)


@pytest.mark.parametrize("with_states", [True, False])
def test_every_launch_matches_its_kernel_signature(with_states):
    """A split fwd+bwd, with or without an initial state and a final-state gradient."""
    h0 = torch.zeros(1, 4, 128, 128) if with_states else None
    call = fwd_bwd(*inputs(32768, 2, 4), h0=h0, with_dht=with_states)
    _, launches, _ = run_recorded(call)
    assert len(launches.calls) == 9
    scans = [params for factory, params, _ in launches.calls if factory.__name__ == "build_partition_scan_kernel"]
    assert [p.get("use_s0", True) for p in scans] == [with_states, with_states]
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("with_h0", [True, False])
def test_unsplit_recompute_launches_match_their_signatures(with_h0):
    """Unsplit, the forward keeping nothing, the fused walk off: the backward recomputes the
    states with the h walk (reading h0 or built not to) and runs the full dh walk and the grad
    kernel, the path that allocates dh / dvn."""
    q, k, v, g, beta = inputs(20101, 16, 32)
    h0 = torch.zeros(5, 32, 128, 128) if with_h0 else None

    def call():
        _, _, saved = tilelang_fwd.tilelang_chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, None, h0, False, VARLEN_CU, partitions=None, save_states=False)
        return tilelang_bwd_impl.tilelang_chunk_gated_delta_rule_bwd(
            torch.zeros_like(v), None, q, k, v, g, beta, None, h0, VARLEN_CU, saved)

    with tilelang_bwd_impl.switches(FUSED_WALK="off"):
        grads, launches, _ = run_recorded(call)
    names = launches.names()
    assert names[2:] == ["build_bwd_h_ws_kernel", "build_bwd_dh_ws_kernel", "build_bwd_grad_group_kernel"]
    assert launches.calls[2][1]["use_initial_state"] is with_h0
    assert_launches_match_signatures(launches)
    assert (grads[5] is not None) is with_h0


def test_direct_launch_calls_the_compiled_module_entry_once_looked_up():
    """With DIRECT_LAUNCH, compile_kernel hands out one launcher per kernel that passes the
    arguments straight to the module's entry function (looked up on the first launch only)."""
    from flash_qla_cp.kernels import tilelang_common

    entry_calls, lookups = [], []

    class Module:
        def main(self, *args):
            entry_calls.append(args)

    class Executable:  # what TileLang gives for a kernel compiled in this process
        def jit(self):
            return Module()

    class Adapter:
        def __init__(self, executable):
            self.executable = executable

        def _get_executable(self):
            lookups.append(1)
            return self.executable

    class Kernel:
        def __init__(self, executable):
            self.adapter = Adapter(executable)

    def factory(n):
        return ("prim_func", n)

    compiled = Kernel(Module())  # as loaded from TileLang's disk cache
    with mock.patch("tilelang.compile", lambda *a, **kw: compiled), \
            mock.patch.dict(tilelang_common._kernel_cache, clear=True), \
            mock.patch.dict(tilelang_common._direct_launchers, clear=True):
        with tilelang_common.switches(DIRECT_LAUNCH=False):  # TileLang's own call path
            assert tilelang_common.compile_kernel(factory, n=3) is compiled
        with tilelang_common.switches(DIRECT_LAUNCH=True):
            launch = tilelang_common.compile_kernel(factory, n=3)
            assert tilelang_common.compile_kernel(factory, n=3) is launch
            assert lookups == []  # nothing loaded before the first launch
            launch("a", 1)
            launch("b", 2)
            assert tilelang_common.compile_kernel(factory, n=4) is not launch
            assert entry_calls == [("a", 1), ("b", 2)] and lookups == [1]
            fresh = tilelang_common.DirectLaunch(Kernel(Executable()))  # as compiled in this process
            fresh("c")
            assert entry_calls[-1] == ("c",)
