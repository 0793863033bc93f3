"""The TileLang backend's host code on the CPU, with every kernel launch recorded instead of run.

GPU kernels cannot run here, but the Python around them can: which kernels one call launches
(the plan's, in order), that each gets as many arguments as its PrimFunc takes with the rank and
dtype of each buffer, and how many torch fill launches a call adds (each is a launch on the GPU:
host time that made small eager calls host-bound on the H200).
"""

import contextlib
import functools
from dataclasses import replace
from unittest import mock

import pytest
import torch

pytest.importorskip("tilelang")

from flash_qla_cp import KernelOptions  # noqa: E402
from flash_qla_cp.kernels import runtime  # noqa: E402
from flash_qla_cp.kernels.backward import tilelang_backward  # noqa: E402
from flash_qla_cp.kernels.forward import tilelang_forward  # noqa: E402

SMS = 132  # an H200


class Launches:
    """Stands in for runtime.compile_kernel: each launch is recorded as (spec, args)."""

    def __init__(self):
        self.calls, self.plans = [], []

    def compile_kernel(self, spec):
        return lambda *args: self.calls.append((spec, args))

    def compile_plan(self, plan, *companions):
        self.plans.append((plan, *companions))

    def names(self):
        return [spec.name for spec, _ in self.calls]

    def params(self, i):
        return self.calls[i][0].kwargs

    def forget_arguments(self):
        """Drops the recorded launches' tensors (which would keep an output's autograd graph alive)."""
        self.calls = [(spec, ()) for spec, _ in self.calls]


@contextlib.contextmanager
def tilelang_chosen(*modules):
    """The TileLang backend chosen where the named modules of the package choose one (it needs a
    GPU, which is not here)."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch(f"flash_qla_cp.{module}.choose_backend", lambda *a: "tilelang"))
        yield


@contextlib.contextmanager
def tilelang_path(launches, backend_modules=("ops", "api")):
    """Kernels recorded by `launches` (an H200's SM count), and the TileLang backend chosen in
    `backend_modules`."""
    with mock.patch.object(runtime, "compile_kernel", launches.compile_kernel), \
            mock.patch.object(runtime, "compile_plan", launches.compile_plan), \
            mock.patch.object(runtime, "sm_count", lambda device: SMS), tilelang_chosen(*backend_modules):
        yield launches


def run_recorded(fn):
    """(fn's result, Launches, number of torch fills) for the second of two calls of fn with
    kernels recorded (the first builds the split plan's cached index tensors)."""
    launches = Launches()
    with mock.patch.object(runtime, "compile_kernel", launches.compile_kernel), \
            mock.patch.object(runtime, "compile_plan", launches.compile_plan), \
            mock.patch.object(runtime, "sm_count", lambda device: SMS):
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


def forward(q, k, v, g, beta, final, keep, cu=None, h0=None, intra_cp="auto"):
    return tilelang_forward(q, k, v, g, beta, q.shape[-1] ** -0.5, h0, final, cu, intra_cp=intra_cp,
                            cu_seqlens_host=None if cu is None else cu.tolist(), save_states=keep)


def fwd_bwd(q, k, v, g, beta, cu=None, h0=None, with_dht=False, keep=True, intra_cp="auto",
            options=KernelOptions()):
    """A training step's two halves: the forward (keeping its states), then the backward (with a
    final-state gradient when with_dht)."""
    do = torch.zeros_like(v)

    def call():
        _, ht, saved = forward(q, k, v, g, beta, with_dht, keep, cu=cu, h0=h0, intra_cp=intra_cp)
        dht = torch.zeros_like(ht) if with_dht else None
        return tilelang_backward(do, dht, q, k, v, g, beta, q.shape[-1] ** -0.5, h0, cu, saved, options=options)

    return call


def compiled_op(q, k, v, g, beta, h0=None, cu=None, final=False, save_states=True):
    """The op through its custom ops, as a compiled graph calls them (intra_cp 'auto'): (o, final state or None)."""
    from flash_qla_cp import library_ops

    return library_ops.compiled_op(q, k, v, g, beta, h0, cu, None, final, False, False, "auto", "auto",
                                   KernelOptions(), save_states)


SPLIT_CU = torch.tensor([0, 40000, 65536], dtype=torch.int32)  # two sequences, long enough to split
VARLEN_CU = torch.tensor([0, 5000, 5003, 12004, 16004, 20101], dtype=torch.int32)


def test_split_forward_launches_five_kernels_and_fills_nothing():
    """TP8 1x32k (2 qk-heads, 4 v-heads, one sequence): cut into partitions, so the forward is
    prepare, decay tables, summaries, scan, walk. Without an initial state the scan starts from
    zero itself (use_s0 off): no fill."""
    q, k, v, g, beta = inputs(32768, 2, 4)
    (o, ht, saved), launches, fills = run_recorded(lambda: forward(q, k, v, g, beta, True, False))
    assert saved.split is not None
    assert launches.names() == ["build_prepare_kernel", "build_decay_tables_kernel", "build_state_summary_kernel",
                                "build_partition_scan_kernel", "build_fused_fwd_ws4_kernel"]
    assert launches.params(3)["use_s0"] is False
    assert fills == 0
    assert o.shape == v.shape and ht.shape == (1, 4, 128, 128)


def test_split_walk_writes_each_sequences_final_state_in_its_row():
    """Packed sequences cut into partitions: the walk's ht has one row per sequence and only a
    sequence's last partition writes it (ht_rows: its sequence's index, -1 for the others); the
    unsplit varlen walk writes row n for sequence n. The op returns that tensor itself, no gather."""
    q, k, v, g, beta = inputs(65536, 2, 4)
    (_, ht, saved), launches, _ = run_recorded(lambda: forward(q, k, v, g, beta, True, False, cu=SPLIT_CU))
    walk = next(args for spec, args in launches.calls if spec.name.startswith("build_fused_fwd"))
    part_cu, rows, walk_ht = walk[5], walk[7], walk[10]
    last = [int(p) - 1 for p in saved.split.seq_parts[1:]]
    assert part_cu.numel() - 1 > 2 and rows.numel() == part_cu.numel() - 1
    assert [int(r) for r in rows] == [last.index(p) if p in last else -1 for p in range(rows.numel())]
    assert walk_ht.shape[0] == 2 and ht.data_ptr() == walk_ht.data_ptr()
    cu = torch.tensor([0, 5000, 5003, 30000, 40000, 65536], dtype=torch.int32)
    (_, ht, _), launches, _ = run_recorded(lambda: forward(q, k, v, g, beta, True, False, cu=cu, intra_cp="off"))
    walk = next(args for spec, args in launches.calls if spec.name.startswith("build_fused_fwd"))
    assert walk[7].tolist() == list(range(5)) and walk[10].shape[0] == 5 and ht.shape[0] == 5
    assert_launches_match_signatures(launches)

def test_wide_heads_stay_whole():
    """K = V = 256: the split's partition scan would not fit in shared memory, so 'auto' leaves
    a long sequence whole (prepare + walk) and an explicit partition count is refused."""
    q, k, v, g, beta = inputs(32768, 2, 4, D=256)
    (_, _, saved), launches, _ = run_recorded(lambda: forward(q, k, v, g, beta, True, False))
    assert launches.names() == ["build_prepare_kernel", "build_fused_fwd_kernel"]
    assert saved.split is None
    with pytest.raises(ValueError, match="head dims <= 128"):
        forward(q, k, v, g, beta, True, False, intra_cp=4)


@pytest.mark.parametrize("H", [2, 4])
def test_wide_heads_backward_with_the_sliced_grad_kernel(H):
    """K = V = 256: the two serial walks (the dh walk at block_v 32, where it fits in shared
    memory), then the V-sliced grad kernel, and (GVA) the v-head sum of its dq / dk parts."""
    q, k, v, g, beta = inputs(5000, H, 4, D=256)
    grads, launches, _ = run_recorded(fwd_bwd(q, k, v, g, beta, h0=torch.zeros(1, 4, 256, 256)))
    names = ["build_prepare_kernel", "build_fused_fwd_kernel", "build_bwd_h_kernel", "build_bwd_dh_kernel",
             "build_bwd_grad_wide_kernel"]
    assert launches.names() == names + (["build_v_head_sum_kernel"] * 2 if H < 4 else [])  # dq's, then dk's
    assert launches.params(2)["block_v"] == launches.params(3)["block_v"] == 32
    assert_launches_match_signatures(launches)
    assert [t.shape for t in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]


def test_split_backward_reads_no_zero_filled_exit_gradients():
    """The split fwd+bwd: the backward adds the warm-up dh walk (starting from zero by
    construction), the reverse scan and the fused walk, which sums dq / dk over the v-heads
    itself (its v-head chain: no v-head sum kernel)."""
    q, k, v, g, beta = inputs(32768, 2, 4)
    grads, launches, fills = run_recorded(fwd_bwd(q, k, v, g, beta))
    assert launches.names()[5:] == ["build_bwd_dh_ws_kernel", "build_partition_scan_kernel",
                                    "build_bwd_fused_ws_kernel"]
    assert launches.params(7)["chain_v_heads"]
    warm = launches.params(5)
    assert warm["limit_chunks"] and not warm["use_dht"]
    assert launches.params(6)["use_s0"] is False  # the reverse scan enters at zero too (no dht)
    assert fills == 0
    assert [t.shape for t in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]


def test_unsplit_varlen_call_needs_no_fill():
    """Several documents on 32 v-heads fill the GPU unsplit: no scan, and without an initial
    state or an exit gradient nothing is zero-filled (the kernels do not read them)."""
    _, launches, fills = run_recorded(fwd_bwd(*inputs(20101, 16, 32), cu=VARLEN_CU))
    assert launches.names() == ["build_prepare_kernel", "build_fused_fwd_ws4_kernel", "build_bwd_fused_ws_kernel"]
    assert fills == 0


@functools.lru_cache(maxsize=None)
def _built(spec):
    return spec.build()


def assert_launches_match_signatures(launches):
    """Each recorded launch passes one argument per PrimFunc parameter, tensors of the buffer's
    rank, fixed sizes and dtype, contiguous and 16-byte aligned (the kernels' vector and TMA accesses): the
    plumbing between the host code and the kernels, checked without a GPU."""
    for spec, args in launches.calls:
        prim = _built(spec)
        assert len(args) == len(prim.params), spec.name
        for var, arg in zip(prim.params, args):
            buf = prim.buffer_map.get(var)
            if buf is None:
                continue
            assert torch.is_tensor(arg), (spec.name, var.name)
            assert arg.dim() == len(buf.shape), (spec.name, buf.name, arg.shape)
            static = [(got, want.value) for got, want in zip(arg.shape, buf.shape) if hasattr(want, "value")]
            assert all(got == want for got, want in static), (spec.name, buf.name, arg.shape, buf.shape)
            assert str(arg.dtype).replace("torch.", "") == str(buf.dtype), (spec.name, buf.name, arg.dtype)
            assert arg.is_contiguous() and arg.data_ptr() % 16 == 0, (spec.name, buf.name, arg.stride())


@pytest.mark.parametrize("with_states", [True, False])
def test_every_launch_matches_its_kernel_signature(with_states):
    """A split fwd+bwd, with or without an initial state and a final-state gradient (5 kernels
    forward, 3 backward: the warm-up dh walk, the reverse scan, the fused walk with its v-head
    chain)."""
    h0 = torch.zeros(1, 4, 128, 128) if with_states else None
    call = fwd_bwd(*inputs(32768, 2, 4), h0=h0, with_dht=with_states)
    _, launches, _ = run_recorded(call)
    assert len(launches.calls) == 8
    scans = [spec.kwargs for spec, _ in launches.calls if spec.name == "build_partition_scan_kernel"]
    assert [p.get("use_s0", True) for p in scans] == [with_states, with_states]
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("with_h0", [True, False])
def test_unsplit_recompute_launches_match_their_signatures(with_h0):
    """Unsplit, the forward keeping nothing, the fused walk off: the backward recomputes the
    states with the h walk (reading h0 or built not to) and runs the full dh walk and the grad
    kernel, the path that allocates dh / dvn."""
    q, k, v, g, beta = inputs(20101, 16, 32)
    h0 = torch.zeros(5, 32, 128, 128) if with_h0 else None

    call = fwd_bwd(q, k, v, g, beta, cu=VARLEN_CU, h0=h0, keep=False, intra_cp="off",
                   options=KernelOptions(fused_walk="off"))
    grads, launches, _ = run_recorded(call)
    names = launches.names()
    assert names[2:] == ["build_bwd_h_ws_kernel", "build_bwd_dh_ws_kernel", "build_bwd_grad_group_kernel"]
    assert launches.params(2)["use_initial_state"] is with_h0
    assert_launches_match_signatures(launches)
    assert (grads[5] is not None) is with_h0


@pytest.mark.parametrize("proj_layout", ["qwen3_next", "qwen3_5"])
def test_fused_layer_launches_its_step_kernels_around_the_op(proj_layout):
    """The fused layer on the TileLang path: conv/l2norm/gates kernel, the op's kernels, the gated
    norm; in the backward the norm's, the op's (on the inputs the forward kept), the inputs'
    backward; every launch with its kernel's signature."""
    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.modules import fused_mixer

    m = GatedDeltaNet(256, 2, 4, 128, 128, proj_layout=proj_layout, backend="torch").to(torch.bfloat16)
    x = torch.zeros(1, 300, 256, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 1, 120, 300], dtype=torch.int32)

    def call():
        config = fused_mixer.MixerConfig(m.projection_layout, False, 1e-6, 128**-0.5, "tilelang", "auto", True)
        P = torch.nn.functional.linear(x, m._projection_weight())
        with mock.patch("flash_qla_cp.ops.choose_backend", lambda *a: "tilelang"):
            y = fused_mixer.fused_mixer(P, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight, config, None, cu)
            y.sum().backward()

    _, launches, _ = run_recorded(call)
    names = launches.names()
    layer = [n for n in names if "layer_inputs" in n or "gated_norm" in n]
    assert layer == ["build_layer_inputs_kernel", "build_gated_norm_kernel", "build_gated_norm_bwd_kernel",
                     "build_layer_inputs_bwd_kernel"]
    assert names[0] == "build_layer_inputs_kernel" and names[-1] == "build_layer_inputs_bwd_kernel"
    assert len(names) > len(layer)  # the op's own kernels in between
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("continuing", [3, 2, 0])
def test_conv_history_gradient_from_the_kernels_first_rows(continuing):
    """The host side of the history gradient (`kernels.layer._history_grad`, from the dy of the
    first K - 1 tokens the backward kernel writes) against autograd through the conv's taps into
    the history, where `continuing` first tokens continue it."""
    from flash_qla_cp.kernels.layer import _history_grad

    W, C = 3, 5
    weight = torch.randn(C, W + 1, dtype=torch.float64)
    dy_head = torch.randn(W, C, dtype=torch.float64)
    positions = torch.tensor([W + i for i in range(continuing)] + list(range(6 - continuing)), dtype=torch.int32)
    history = torch.randn(W, C, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, C, dtype=torch.float64)
    ext = torch.cat([history, x])
    y = torch.stack([sum(weight[:, j] * ext[t + j] for j in range(W + 1) if int(positions[t]) >= W - j)
                     for t in range(W)])
    (y * dy_head).sum().backward()
    assert torch.allclose(_history_grad(dy_head, weight, positions), history.grad, atol=1e-12)


@pytest.mark.parametrize("case", ["dense", "varlen_h0", "split", "varlen_split"])
def test_training_forward_compiles_the_backward_it_will_need(case):
    """A forward that keeps its states and returns no final state compiles, with its own plan, the
    backward plan the following backward then asks for (one round of compilation, not two)."""
    from flash_qla_cp.ops import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

    T, cu, h0 = {"dense": (4096, None, None), "varlen_h0": (20101, VARLEN_CU, torch.zeros(5, 4, 128, 128)),
                 "split": (32768, None, None), "varlen_split": (65536, SPLIT_CU, None)}[case]
    q, k, v, g, beta = inputs(T, 2, 4)

    def call():
        with mock.patch("flash_qla_cp.ops.choose_backend", lambda *a: "tilelang"):
            o, _, ctx = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                                   backend="tilelang", intra_cp="auto" if "split" in case else "off",
                                                   save_states=True)
            return chunk_gated_delta_rule_bwd(torch.zeros_like(o), None, ctx)

    launches = Launches()
    with mock.patch.object(runtime, "compile_kernel", launches.compile_kernel), \
            mock.patch.object(runtime, "compile_plan", launches.compile_plan), \
            mock.patch.object(runtime, "sm_count", lambda device: SMS):
        call()
    (forward_plan, predicted), (backward_plan,) = launches.plans
    assert predicted == backward_plan
    assert ("build_decay_tables_kernel" in [s.name for s in forward_plan.specs()]) == ("split" in case)


def test_split_varlen_backward_walks_the_forwards_partitions():
    """Packed sequences cut into partitions: the backward's walks take the partitions' offsets
    (those of the forward's walk) and write one entering-state gradient per partition, then one
    per sequence for the caller."""
    q, k, v, g, beta = inputs(65536, 2, 4)
    h0 = torch.zeros(2, 4, 128, 128)
    _, launches, _ = run_recorded(fwd_bwd(q, k, v, g, beta, cu=SPLIT_CU, h0=h0))
    forward_walk = next(args for spec, args in launches.calls if spec.name.startswith("build_fused_fwd"))
    part_cu = forward_walk[5]
    assert part_cu.numel() - 1 > 2  # split
    warmup = next(args for spec, args in launches.calls if spec.kwargs.get("limit_chunks"))
    assert torch.equal(warmup[5], part_cu) and warmup[9].shape[0] == part_cu.numel() - 1  # (cu, dh0)
    walks = [(spec, args) for spec, args in launches.calls if spec.name.startswith(("build_bwd_dh", "build_bwd_fused"))]
    for spec, args in walks:  # every backward walk reads the partitions' offsets, none the sequences'
        offsets = [a for a in args if torch.is_tensor(a) and a.dtype == torch.int32 and a.dim() == 1
                   and a.numel() in (part_cu.numel(), SPLIT_CU.numel()) and int(a[-1]) == 65536]
        assert len(offsets) == 1 and torch.equal(offsets[0], part_cu), spec.name
    assert_launches_match_signatures(launches)


def test_kept_chunk_states_are_saved_the_autograd_way():
    """The op's and the fused layer's kept chunk states (h_states [NC, HV, K, V]) go through
    autograd's saved-tensor hooks, so activation checkpointing drops them after the forward
    instead of holding them until the backward; the backward gets them back."""
    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.api import chunk_gated_delta_rule
    from flash_qla_cp.modules import fused_mixer

    q, k, v, g, beta = (t.requires_grad_(True) for t in inputs(4096, 2, 4))
    m = GatedDeltaNet(256, 2, 4, 128, 128, backend="torch").to(torch.bfloat16)
    P = torch.zeros(1, 4096, m.projection_layout.width, dtype=torch.bfloat16, requires_grad=True)
    config = fused_mixer.MixerConfig(m.projection_layout, False, 1e-6, 128**-0.5, "tilelang", "off", True)
    calls = {
        "op": lambda: chunk_gated_delta_rule(q, k, v, g, beta, backend="tilelang", intra_cp="off")[0],
        "layer": lambda: fused_mixer.fused_mixer(P, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight, config),
    }
    for name, call in calls.items():
        packed = []
        launches = Launches()
        with tilelang_path(launches):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
                out = call()
            out.float().sum().backward()
        assert (64, 4, 128, 128) in packed, (name, packed)
        assert any("bwd" in n for n in launches.names()), name  # the backward ran on what it got back


@pytest.mark.parametrize("checkpointed", [False, True])
def test_training_step_leaves_no_tensor_in_a_reference_cycle(checkpointed):
    """A tensor in a reference cycle lives until Python's cyclic GC happens to run: kept chunk
    states held that way stayed alive through the rest of the backward (under activation
    checkpointing every layer's recomputed ones piled up, ~90 KiB a token in the training recipe).
    The op's and the fused layer's forward and backward (recorded TileLang path) create none."""
    import gc

    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.api import chunk_gated_delta_rule

    q, k, v, g, beta = (t.requires_grad_(True) for t in inputs(4096, 2, 4))
    m = GatedDeltaNet(256, 2, 4, 128, 128).to(torch.bfloat16)
    x = torch.zeros(1, 4096, 256, dtype=torch.bfloat16, requires_grad=True)
    calls = {
        "op": lambda: chunk_gated_delta_rule(q, k, v, g, beta, backend="tilelang", intra_cp="off")[0],
        "layer": lambda: m(x),
    }
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free lands in gc.garbage instead
    try:
        for name, call in calls.items():
            with tilelang_path(Launches()), tilelang_chosen("modules.fused_mixer", "modules.gated_deltanet"):
                out = torch.utils.checkpoint.checkpoint(call, use_reentrant=False) if checkpointed else call()
                out.float().sum().backward()
            del out
            gc.collect()
            cycled = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
            gc.garbage.clear()
            assert not cycled, (name, cycled)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("block_tokens", [16, 32, 64])
def test_layer_steps_launch_the_block_size_asked_for(block_tokens):
    """The layer's step kernels take a block size (tools/tune_layer.py sweeps it): the backward
    steps launch that variant with their per-block gradient parts sized for it."""
    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.kernels import layer as steps
    from flash_qla_cp.reference.layer_steps import token_positions

    m = GatedDeltaNet(256, 2, 4, 128, 128).to(torch.bfloat16)
    lay, NT = m.projection_layout, 300
    P = torch.zeros(NT, lay.width, dtype=torch.bfloat16)
    o = torch.zeros(NT, 4, 128, dtype=torch.bfloat16)
    grads = (o[:, :2], o[:, :2], o, torch.zeros(NT, 4), torch.zeros(NT, 4), o)
    positions = token_positions(1, NT, None, "cpu")
    with tilelang_path(Launches()) as launches:
        steps.op_inputs_backward(*grads, P, lay, m.conv1d.weight, m.A_log, m.dt_bias, positions, False,
                                 torch.empty_like(P), tuning={"block_tokens": block_tokens})
        steps.gated_norm_backward(o.view(NT, -1), o, P, lay, m.norm.weight, 1e-6,
                                  tuning={"block_tokens": block_tokens})
    parts = {"build_layer_inputs_bwd_kernel": 13, "build_gated_norm_bwd_kernel": 6}  # dweight_part's argument
    for spec, args in launches.calls:
        assert spec.kwargs["block_tokens"] == block_tokens
        assert args[parts[spec.name]].shape[0] == -(-NT // block_tokens), spec.name
    assert_launches_match_signatures(launches)


class HostReads(torch.Tensor):
    """cu_seqlens that counts its reads to the host (.cpu(), .tolist(), .item(), of it or of a
    tensor computed from it): on a GPU each one waits for the work queued before it."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy):
            HostReads.reads += 1
            args = [a.as_subclass(torch.Tensor) if isinstance(a, HostReads) else a for a in args]
            return func(*args, **(kwargs or {}))  # a host copy: reading it costs nothing more
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "steps"])
def test_layer_reads_cu_seqlens_back_once_per_tensor(fused):
    """The layer reads a new cu_seqlens back once (its check) and hands that copy to the op, whose
    forward (split planning, chunk tables) and backward then read nothing back; the same tensor,
    unchanged, is not read back again (a model's layers share it), and is after a change."""
    from flash_qla_cp import GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128).to(torch.bfloat16)
    if not fused:
        m._fused_backend = lambda *args: None
    x = torch.zeros(1, 300, 256, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([0, 1, 120, 300], dtype=torch.int32)
    reads = []
    with tilelang_chosen("ops", "api", "modules.fused_mixer", "modules.gated_deltanet"):
        def call(cu):
            HostReads.reads = 0
            m(x, cu_seqlens=cu).float().sum().backward()
            reads.append(HostReads.reads)

        def calls():
            call(offsets.clone().as_subclass(HostReads))
            shared = offsets.clone().as_subclass(HostReads)
            call(shared)
            call(shared)
            shared[1:2].fill_(2)
            call(shared)

        _, launches, _ = run_recorded(calls)
    assert any("layer_inputs" in n for n in launches.names()) is fused
    assert any("bwd" in n for n in launches.names())
    assert reads == [1, 1, 0, 1] * 2


@pytest.mark.parametrize("intra_cp", ["off", "auto"])
def test_varlen_op_given_a_host_copy_reads_nothing_back(intra_cp):
    """With cu_seqlens_cpu the op's forward and backward read nothing back from the GPU, split or
    not (a read-back waits for the queue, and a CUDA graph capture refuses it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):  # .item() / int() of any tensor (here all are CPU tensors)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func == torch.ops.aten._local_scalar_dense.default:
                HostReads.reads += 1
            return func(*args, **(kwargs or {}))

    q, k, v, g, beta = inputs(20101, 16, 32)
    cu, host = VARLEN_CU.as_subclass(HostReads), VARLEN_CU.clone()

    def call():  # (the second call is counted: the first builds the host plan's cached tables)
        HostReads.reads = 0
        with ScalarReads():
            _, _, saved = tilelang_forward(q, k, v, g, beta, 128**-0.5, None, False, cu, intra_cp=intra_cp,
                                           cu_seqlens_host=host, save_states=True)
            return tilelang_backward(torch.zeros_like(v), None, q, k, v, g, beta, 128**-0.5, None, cu, saved)

    _, launches, _ = run_recorded(call)
    assert "build_bwd_fused_ws_kernel" in launches.names()
    assert HostReads.reads == 0


def test_fused_layer_backward_holds_one_projection_sized_buffer_through_the_op():
    """Peak memory: while the op's backward walks, the only tensor of the projection rows' size
    alive is P itself (kept from the forward); dP is allocated after the op's buffers are freed."""
    import gc
    import warnings

    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.modules import fused_mixer

    m = GatedDeltaNet(256, 2, 4, 128, 128, backend="torch").to(torch.bfloat16)
    P = torch.zeros(1, 4096, m.projection_layout.width, dtype=torch.bfloat16, requires_grad=True)
    config = fused_mixer.MixerConfig(m.projection_layout, False, 1e-6, 128**-0.5, "tilelang", "off", True)
    seen = []

    class Watching(Launches):
        def compile_kernel(self, spec):
            def launch(*args):
                if spec.name.startswith(("build_bwd_fused", "build_bwd_dh")):  # the op's backward walk
                    gc.collect()
                    with warnings.catch_warnings():  # (the scan touches torch's deprecated module attributes)
                        warnings.simplefilter("ignore", FutureWarning)
                        tensors = [t for t in gc.get_objects() if torch.is_tensor(t)]
                    seen.append(len({t.untyped_storage().data_ptr() for t in tensors
                                     if t.untyped_storage().nbytes() == P.untyped_storage().nbytes()}))
                self.calls.append((spec, args))
            return launch

    with tilelang_path(Watching(), ("ops",)):
        y = fused_mixer.fused_mixer(P, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight, config)
        y.float().sum().backward()
    assert seen and all(n == 1 for n in seen), seen
    assert P.grad is not None and P.grad.shape == P.shape


def _gpu_op_cases():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpu"))
    import test_op

    # (the 16 / 32-head and 128k-token cases repeat paths of smaller ones, at CPU cost)
    return {name: case for name, case in test_op.CASES.items() if sum(case.lengths) * case.HV <= 200_000}


@pytest.mark.parametrize("name", list(_gpu_op_cases()))
def test_gpu_cases_host_paths_run_and_match_their_kernels(name):
    """Every case of tests/gpu/test_op.py through the public op on the TileLang path, here with
    launches recorded: the host code runs to the end (buffers of the sizes autograd expects) and
    each launch matches its kernel's signature, before a GPU session is spent on it."""
    from gdn_checks import make_inputs, run_op

    case = _gpu_op_cases()[name]
    with tilelang_path(Launches()) as launches:
        out = run_op(case, make_inputs(case), "cpu", "tilelang")
    assert ("dh0" in out) == case.with_h0
    assert any(spec.name.startswith("build_bwd") for spec, _ in launches.calls)
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("name", ["varlen_odd", "varlen_vfirst"])
def test_gpu_compiled_op_cases_host_paths_run_and_match_their_kernels(name):
    """tests/gpu/test_op.py's compiled cases (torch.compile of the op: its custom ops, the kept
    chunk states handed to the backward by handle) on the TileLang path with launches recorded:
    the eager call's kernels, in order, and no kept states left over."""
    from gdn_checks import make_inputs, run_op

    from flash_qla_cp import chunk_gated_delta_rule, kept_states

    case = _gpu_op_cases()[name]
    inputs = make_inputs(case)
    with tilelang_path(Launches(), ("ops", "api", "library_ops")) as eager:
        run_op(case, inputs, "cpu", "tilelang")
    torch._dynamo.reset()
    with tilelang_path(Launches(), ("ops", "api", "library_ops")) as launches:
        out = run_op(case, inputs, "cpu", "tilelang",
                     op=torch.compile(chunk_gated_delta_rule, fullgraph=True, backend="aot_eager"))
    assert ("dh0" in out) == case.with_h0
    assert any(n.startswith("build_bwd") for n in launches.names())
    assert launches.names() == eager.names()
    assert kept_states.filed() == 0
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("intra_cp,exact", [(8, True), ("auto", False)])
def test_gpu_cp_case_host_path_runs_and_matches_its_kernels(intra_cp, exact):
    """tests/gpu/test_cp.py's single-process CP context (the torch split engine around the
    TileLang op) on the CPU with launches recorded, as above."""
    from flash_qla_cp import CPContext

    _gpu_op_cases()  # (puts tests/gpu on the path)
    from gdn_checks import make_inputs, run_op
    from test_cp import CASE

    inputs = make_inputs(CASE)
    with tilelang_path(Launches(), ("ops", "api", "parallel.dual")) as launches:
        out = run_op(CASE, inputs, "cpu", "tilelang",
                     cp_context=CPContext.single(inputs.cu, intra_cp=intra_cp, intra_exact=exact))
    assert "dh0" in out
    assert any(spec.name.startswith("build_bwd") for spec, _ in launches.calls)
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("save_states", [True, False], ids=["", "save_states_off"])
@pytest.mark.parametrize("lengths", [(40000, 25536), (4096, 1, 300)], ids=["split", "unsplit"])
@pytest.mark.parametrize("traced", [False, True], ids=["", "compiled_path"])
def test_fused_layer_compiles_only_kernels_it_launches(lengths, traced, save_states):
    """A training step of the fused layer compiles all its kernels in one round before the first
    launch (the op's forward with the backward it predicts and both layer steps, the inputs
    step's forward kernel included): every kernel compiled is launched in that step, so no round
    spends minutes on a kernel the step does not use. The same along the compiled path (the
    custom ops a torch.compile graph calls), whose backward runs the op's forward again, and with
    save_states off (the backward recomputes the chunk states)."""
    from flash_qla_cp.kernels.layer import StepPlan

    from flash_qla_cp import GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128, intra_cp="auto", save_states=save_states).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.zeros(1, sum(lengths), 256, dtype=torch.bfloat16, requires_grad=True)
    launches = Launches()
    compile_plan, launched_before = launches.compile_plan, []
    launches.compile_plan = lambda *plans: launched_before.append(len(launches.calls)) or compile_plan(*plans)
    with tilelang_path(launches, ("ops", "modules.fused_mixer", "modules.gated_deltanet")), \
            mock.patch.object(torch.compiler, "is_compiling", lambda: traced):
        m(x, cu_seqlens=cu).float().sum().backward()
    launched = {spec for spec, _ in launches.calls}
    compiled = {spec for plans in launches.plans for plan in plans for spec in plan.specs()}
    assert compiled and compiled <= launched, sorted(s.name for s in compiled - launched)
    ready, rounds = set(), []  # the compile_plan calls that would compile something (runtime's rule)
    for plans, launches_so_far in zip(launches.plans, launched_before):
        if any(p not in ready for p in plans):
            rounds.append((plans, launches_so_far))
            ready.update(plans)
    assert len(rounds) == 1 and rounds[0][1] == 0  # one round, before anything launched
    assert launched == compiled
    rounds = [plans for plans, _ in rounds]
    assert sum(isinstance(p, StepPlan) for p in rounds[0]) == 2
    step_kernels = {spec for p in rounds[0] if isinstance(p, StepPlan) for spec in p.specs()}
    assert {s.name for s in step_kernels} == {"build_layer_inputs_kernel", "build_layer_inputs_bwd_kernel",
                                              "build_gated_norm_kernel", "build_gated_norm_bwd_kernel"}


@pytest.mark.parametrize("use_cache,traced", [(False, False), (True, False), (False, True)],
                         ids=["forward", "prefill", "compiled_path"])
def test_fused_layer_inference_compiles_no_backward_kernel(use_cache, traced):
    """Under no_grad (a forward, a prompt's prefill with the cache out) the first call's one round
    compiles the kernels the call launches and no backward kernel (minutes of compilation that
    inference would never use)."""
    from flash_qla_cp import GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128).to(torch.bfloat16).eval()
    launches = Launches()
    with torch.no_grad(), tilelang_path(launches, ("ops", "modules.fused_mixer", "modules.gated_deltanet")), \
            mock.patch.object(torch.compiler, "is_compiling", lambda: traced):
        m(torch.zeros(2, 300, 256, dtype=torch.bfloat16), use_cache=use_cache)
    compiled = {spec for plans in launches.plans for plan in plans for spec in plan.specs()}
    assert compiled == {spec for spec, _ in launches.calls}
    assert not any("bwd" in spec.name for spec in compiled)


@pytest.mark.parametrize("lengths", [(40000, 25536), None], ids=["split", "dense"])
@pytest.mark.parametrize("traced", [False, True], ids=["", "compiled_path"])
def test_fused_layer_inference_walk_applies_the_gated_norm(lengths, traced):
    """Under no_grad, where the op's walk holds whole 128-wide rows of o (the four-warpgroup walk:
    a split long sequence, or enough dense rows to fill the GPU), the walk applies the gated norm
    and writes y (it takes P and the norm's weight), so the layer launches no gated-norm kernel
    and compiles none; the first call's one round compiles exactly what it launches."""
    from flash_qla_cp import GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128, intra_cp="auto").to(torch.bfloat16).eval()
    if lengths is None:
        cu, x = None, torch.zeros(40, 300, 256, dtype=torch.bfloat16)  # 160 walks of one 128-wide block
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.zeros(1, sum(lengths), 256, dtype=torch.bfloat16)
    launches = Launches()
    with torch.no_grad(), tilelang_path(launches, ("ops", "modules.fused_mixer", "modules.gated_deltanet")), \
            mock.patch.object(torch.compiler, "is_compiling", lambda: traced):
        y = m(x, cu_seqlens=cu)
    assert y.shape == x.shape
    names = launches.names()
    assert "build_gated_norm_kernel" not in names and names[-1] == "build_fused_fwd_ws4_kernel"
    walk, args = launches.calls[-1]
    width = m.projection_layout.width
    assert walk.kwargs["gated_norm"] == (width, m.projection_layout.z_offset, m.projection_layout.z_head_stride, 1e-6)
    P, weight = args[-2:]
    assert P.shape == (1, x.shape[0] * x.shape[1], width)  # packed: the walks take every batch so
    assert weight.dtype == torch.float32 and weight.shape == (128,)
    compiled = {spec for plans in launches.plans for plan in plans for spec in plan.specs()}
    assert compiled == {spec for spec, _ in launches.calls}
    assert_launches_match_signatures(launches)


def test_fused_layer_training_forward_keeps_the_gated_norm_apart():
    """With a backward to follow the walk writes o (the norm's backward reads it) and the gated-norm
    kernel runs after it."""
    from flash_qla_cp import GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128, intra_cp="auto").to(torch.bfloat16)
    cu = torch.tensor([0, 40000, 65536], dtype=torch.int32)
    x = torch.zeros(1, 65536, 256, dtype=torch.bfloat16, requires_grad=True)
    launches = Launches()
    with tilelang_path(launches, ("ops", "modules.fused_mixer", "modules.gated_deltanet")):
        m(x, cu_seqlens=cu)
    names = launches.names()
    walk = next(spec for spec, _ in launches.calls if spec.name.startswith("build_fused_fwd"))
    assert "gated_norm" not in walk.kwargs and names[-1] == "build_gated_norm_kernel"


def test_fused_layer_under_a_cp_context_launches_match_their_kernels():
    """The fused layer's CP form (layer inputs with the conv halo, the CP op, the gated norm) on the
    TileLang path of a single-process context: its kernels, in order, with their signatures."""
    from flash_qla_cp import CPContext, GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128).to(torch.bfloat16)
    cu = torch.tensor([0, 40000, 65536], dtype=torch.int32)
    x = torch.zeros(1, 65536, 256, dtype=torch.bfloat16, requires_grad=True)
    with tilelang_chosen("ops", "api", "parallel.dual", "modules.fused_mixer", "modules.gated_deltanet"):
        cp = CPContext.single(cu, intra_cp="auto")
        _, launches, _ = run_recorded(lambda: m(x, cu_seqlens=cu, cp_context=cp).float().sum().backward())
    names = launches.names()
    assert names[0] == "build_layer_inputs_kernel" and names[-1] == "build_layer_inputs_bwd_kernel"
    assert names.index("build_gated_norm_kernel") < names.index("build_gated_norm_bwd_kernel")
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("save_states", [True, False])
@pytest.mark.parametrize("lengths", [(40000, 25536), (4096, 1, 300)], ids=["fused_walk", "grad_kernel"])
def test_fused_layer_backward_reads_what_the_op_leaves(lengths, save_states):
    """GVA: where the op's backward writes dq, dk once per v-head (the fused walk), the fused
    layer's inputs kernel reads those parts and sums them (no v-head sum launch, no summed dq / dk
    buffers); where the grad kernel writes them summed, it reads them so. With save_states the
    forward keeps the op's inputs with its chunk states (the backward runs no h walk and forms no
    inputs); without, the backward re-forms them."""
    from flash_qla_cp import GatedDeltaNet

    m = GatedDeltaNet(256, 2, 4, 128, 128, intra_cp="auto", save_states=save_states).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.zeros(1, sum(lengths), 256, dtype=torch.bfloat16, requires_grad=True)
    with tilelang_chosen("ops", "modules.fused_mixer", "modules.gated_deltanet"):
        _, launches, _ = run_recorded(lambda: m(x, cu_seqlens=cu).float().sum().backward())
    names = launches.names()
    fused_walk = "build_bwd_fused_ws_kernel" in names
    assert fused_walk == (lengths[0] == 40000)
    assert "build_v_head_sum_kernel" not in names
    inputs_bwd = [spec for spec, _ in launches.calls if spec.name == "build_layer_inputs_bwd_kernel"]
    assert [s.kwargs.get("grad_parts", 1) for s in inputs_bwd] == [2 if fused_walk else 1]
    h_walk = any(n in names for n in ("build_bwd_h_kernel", "build_bwd_h_ws_kernel"))
    assert h_walk == (not save_states)
    inputs = [spec for spec, _ in launches.calls if spec.name == "build_layer_inputs_kernel"]
    assert len(inputs) == (1 if save_states else 2)
    assert_launches_match_signatures(launches)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "steps"])
def test_a_decoding_step_has_no_value_dependent_op_or_lifted_scalar(fused):
    """What a CUDA graph capture refuses: no op whose output size depends on values (nonzero) and
    no Python scalar lifted into a host tensor to be copied to the device (an indexed assignment of
    a float), in a decoding step after warm-up, fused (TileLang host path) and step by step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flash_qla_cp import GatedDeltaNet

    class Refused(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.nonzero.default, torch.ops.aten.lift_fresh.default):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    m = GatedDeltaNet(256, 2, 4, 64, 64).to(torch.bfloat16).eval()
    if not fused:
        m._fused_backend = lambda *args: None
    launches = Launches()
    with torch.no_grad(), tilelang_path(launches, ("ops", "modules.fused_mixer", "modules.gated_deltanet")):
        _, cache = m(torch.zeros(3, 70, 256, dtype=torch.bfloat16), use_cache=True)
        token = torch.zeros(3, 1, 256, dtype=torch.bfloat16)
        m(token, cache=cache, use_cache=True)  # warm-up: builds the cached tables of this shape
        launches.calls.clear()
        refused = Refused()
        with refused:
            m(token, cache=cache, use_cache=True)
    assert (len(launches.calls) > 0) == fused
    assert refused.seen == []


def test_a_fused_decoding_step_forms_no_index_tables():
    """A fused decoding step after warm-up reuses its shape's row tables (history rows, positions,
    the conv state's rows): no arange / repeat_interleave / cumsum, each a launch (host time eager,
    replay time in a CUDA graph)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flash_qla_cp import GatedDeltaNet

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    m = GatedDeltaNet(256, 2, 4, 64, 64).to(torch.bfloat16).eval()
    launches = Launches()
    with torch.no_grad(), tilelang_path(launches, ("ops", "modules.fused_mixer", "modules.gated_deltanet")):
        _, cache = m(torch.zeros(3, 70, 256, dtype=torch.bfloat16), use_cache=True)
        token = torch.zeros(3, 1, 256, dtype=torch.bfloat16)
        m(token, cache=cache, use_cache=True)
        seen = Seen()
        with seen:
            m(token, cache=cache, use_cache=True)
    assert launches.calls
    assert not {"arange", "repeat_interleave", "cumsum"} & set(seen.ops), sorted(set(seen.ops))


@pytest.mark.parametrize("lengths,H", [((40000, 25536), 2), ((40000, 25536), 4), ((4096, 1, 300), 2)],
                         ids=["fused_walk_chain", "fused_walk_mha", "grad_kernel"])
def test_a_backward_spends_what_the_forward_kept(lengths, H):
    """Where the fused backward walk writes dk per v-head (MHA here: the shape of the v
    residuals), it writes it into the residuals' memory (it reads a chunk's residuals before it
    writes that chunk's dk); summing over v-heads in its chain, or in the grad kernel, dk is a
    new tensor. After the walks the backward frees the other kept tensors (chunk states, Ag, G,
    the residuals where dk is not in them); a second backward over the same forward
    (retain_graph) recomputes them."""
    from flash_qla_cp.api import chunk_gated_delta_rule

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta = (t.requires_grad_(True) for t in inputs(sum(lengths), H, 4))
    launches = Launches()
    with tilelang_path(launches):
        o = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="tilelang", intra_cp="auto")[0]
        o.float().sum().backward(retain_graph=True)
        first = list(launches.calls)
        launches.calls.clear()
        o.float().sum().backward()
    walk_names = ("build_bwd_fused_ws_kernel", "build_bwd_grad_group_kernel")
    fused = any(spec.name == walk_names[0] for spec, _ in first)
    assert fused == (lengths[0] == 40000)
    assert not any(spec.name.startswith(("build_bwd_h", "build_prepare")) for spec, _ in first[2:])
    walk_args = next(args for spec, args in first if spec.name in walk_names)
    vres, dk, h = walk_args[3], walk_args[14], walk_args[8 if fused else 9]
    in_residuals = fused and H == 4
    assert (dk.data_ptr() == vres.data_ptr()) == in_residuals
    assert h.untyped_storage().nbytes() == 0  # freed once the walks were done
    assert (vres.untyped_storage().nbytes() == 0) == (not in_residuals)
    second = [spec.name for spec, _ in launches.calls]
    assert second[0] == "build_prepare_kernel" and second[1].startswith("build_bwd_h")
    h_walk = launches.calls[1][1]
    assert h_walk[-1].data_ptr() != vres.data_ptr()


@pytest.mark.parametrize("save_states", [True, False], ids=["", "save_states_off"])
@pytest.mark.parametrize("with_states", [False, True], ids=["", "h0_and_final_state"])
def test_compiled_op_backward_runs_the_eager_kernels(with_states, save_states):
    """Under torch.compile the op's backward custom op takes the forward's kept chunk states by
    handle and launches the eager backward's kernels. With save_states off it runs the forward
    again (its split, its chunk states kept), then the eager backward's kernels: the forward's
    partitions and the fused walk, not one unsplit walk per head."""
    q, k, v, g, beta = inputs(32768, 2, 4)  # TP8 1 x 32k: split by intra_cp="auto"
    h0 = torch.zeros(1, 4, 128, 128) if with_states else None
    eager, eager_forward = Launches(), Launches()
    with tilelang_path(eager):
        fwd_bwd(q, k, v, g, beta, h0=h0, with_dht=with_states)()
    with tilelang_path(eager_forward):
        forward(q, k, v, g, beta, with_states, True, h0=h0)
    backward_launches = len(eager.calls) - len(eager_forward.calls)
    compiled = Launches()
    with tilelang_path(compiled, ("ops", "api", "library_ops")):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o, final = compiled_op(*leaves, h0=h0, final=with_states, save_states=save_states)
        forward_launches = len(compiled.calls)
        (o.sum() + (final.sum() if with_states else 0)).backward()
    # (save_states off: the forward again, its split, no final state to return), then the eager
    # backward's kernels
    again = compiled.names()[forward_launches:-backward_launches]
    if save_states:
        assert again == []
    else:
        assert again[0] == "build_prepare_kernel" and again[-1] == "build_fused_fwd_ws4_kernel"
    assert "build_bwd_fused_ws_kernel" in eager.names()
    assert [spec for spec, _ in compiled.calls[-backward_launches:]] == \
        [spec for spec, _ in eager.calls[len(eager_forward.calls):]]
    assert_launches_match_signatures(compiled)


@pytest.mark.parametrize("traced", [False, True], ids=["custom_ops", "torch_compile"])
def test_compiled_op_kept_states_live_as_long_as_the_graph(traced):
    """The chunk states a compiled forward files for its backward go with its autograd graph:
    taken by the backward, dropped with a graph that never runs one; a second backward of a
    retained graph finds none and runs the forward again. Through the custom ops as a compiled
    graph calls them, and through torch.compile (aot_eager)."""
    from flash_qla_cp import chunk_gated_delta_rule, kept_states

    q, k, v, g, beta = inputs(8192, 2, 4)
    torch._dynamo.reset()
    op = torch.compile(chunk_gated_delta_rule, fullgraph=True, backend="aot_eager") if traced else compiled_op
    with tilelang_path(Launches(), ("ops", "api", "library_ops")) as launches:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o, _ = op(*leaves)
        assert kept_states.filed() == 1
        launches.forget_arguments()
        del o
        assert kept_states.filed() == 0
        o, _ = op(*leaves)
        forward_end = len(launches.calls)
        o.sum().backward(retain_graph=True)
        first_end = len(launches.calls)
        assert kept_states.filed() == 0
        o.sum().backward()
    names = launches.names()
    assert "build_prepare_kernel" not in names[forward_end:first_end]
    backward = names[forward_end:first_end]
    assert names[first_end] == "build_prepare_kernel"  # the forward again, then the same backward
    assert backward and names[-len(backward):] == backward


def test_compiled_op_under_activation_checkpointing_keeps_nothing_past_the_forward():
    """torch.utils.checkpoint around the compiled op's custom ops: the checkpointed forward drops
    the handle, and its kept chunk states with it; the backward's recomputed forward files new ones,
    which its backward takes: the same launches as the eager op under checkpointing."""
    from torch.utils.checkpoint import checkpoint

    from flash_qla_cp import chunk_gated_delta_rule, kept_states

    q, k, v, g, beta = inputs(8192, 2, 4)

    def step(op):
        launches = Launches()
        with tilelang_path(launches, ("ops", "api", "library_ops")):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
            o = checkpoint(lambda *t: op(*t)[0], *leaves, use_reentrant=False)
            launches.forget_arguments()
            filed = kept_states.filed()
            o.sum().backward()
        return launches.names(), filed

    compiled, filed = step(compiled_op)
    eager, _ = step(lambda *t: chunk_gated_delta_rule(*t, intra_cp="auto"))
    assert filed == 0 and kept_states.filed() == 0
    assert compiled == eager and compiled.count("build_prepare_kernel") == 2  # the forward, its recompute


@pytest.mark.parametrize("save_states", [True, False], ids=["", "save_states_off"])
def test_compiled_fused_layer_backward_walks_the_forwards_partitions(save_states):
    """The fused layer's compiled path (its custom ops, as a compiled graph calls them): the eager
    layer's kernels, the backward taking the forward's chunk states by handle; with save_states
    off, the backward launches the eager backward's op kernels after the op's forward again."""
    from flash_qla_cp import GatedDeltaNet, kept_states
    from flash_qla_cp.modules import fused_mixer

    m = GatedDeltaNet(256, 2, 4, 128, 128, backend="torch").to(torch.bfloat16)
    x = torch.zeros(1, 32768, 256, dtype=torch.bfloat16, requires_grad=True)
    config = fused_mixer.MixerConfig(m.projection_layout, False, 1e-6, 128**-0.5, "tilelang", "auto", True)

    def step(compiled):
        launches = Launches()
        with tilelang_path(launches, ("ops",)), mock.patch.object(torch.compiler, "is_compiling", lambda: compiled):
            P = torch.nn.functional.linear(x, m._projection_weight())
            y = fused_mixer.fused_mixer(P, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight,
                                        replace(config, save_states=save_states or not compiled))
            forward_launches = len(launches.calls)
            y.sum().backward()
        return launches, forward_launches

    eager, _ = step(False)
    compiled, compiled_forward = step(True)
    assert "build_bwd_fused_ws_kernel" in eager.names()
    assert kept_states.filed() == 0
    if save_states:
        assert [spec for spec, _ in compiled.calls] == [spec for spec, _ in eager.calls]
    else:  # the compiled forward keeps nothing; its backward: the eager forward's and backward's op kernels
        op = [spec for spec, _ in eager.calls if "layer_inputs" not in spec.name and "gated_norm" not in spec.name]
        after_forward = [spec for spec, _ in compiled.calls[compiled_forward:]
                         if "layer_inputs" not in spec.name and "gated_norm" not in spec.name]
        assert after_forward == op
    assert_launches_match_signatures(compiled)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "compiled_path"])
@pytest.mark.parametrize("save_states", [True, False], ids=["", "save_states_off"])
@pytest.mark.parametrize("cu", [None, SPLIT_CU], ids=["dense", "varlen_split"])
def test_op_first_fwd_bwd_compiles_in_one_round(cu, save_states, traced):
    """The op's forward, knowing a backward follows, compiles with its own kernels those of its
    backward (with save_states off: the backward that recomputes the chunk states; along the
    compiled path, the forward that backward runs again and its backward): one round, before any
    launch."""
    from flash_qla_cp import chunk_gated_delta_rule

    q, k, v, g, beta = inputs(65536 if cu is not None else 32768, 2, 4)
    launches = Launches()
    compile_plan, launched_before = launches.compile_plan, []
    launches.compile_plan = lambda *plans: launched_before.append(len(launches.calls)) or compile_plan(*plans)
    with tilelang_path(launches, ("ops", "api", "library_ops")):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        if traced:
            o, _ = compiled_op(*leaves, cu=cu, save_states=save_states)
        else:
            o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu, cu_seqlens_cpu=cu, intra_cp="auto",
                                          save_states=save_states)
        o.backward(torch.zeros_like(o))
    ready, rounds = set(), []
    for plans, launches_so_far in zip(launches.plans, launched_before):
        if any(p not in ready for p in plans):
            rounds.append(launches_so_far)
            ready.update(plans)
    assert rounds == [0]
    assert {spec for plans in launches.plans for p in plans for spec in p.specs()} == \
        {spec for spec, _ in launches.calls}
