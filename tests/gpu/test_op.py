"""The public op on the TileLang backend, forward and backward, against float64 on the GPU.

Each case runs twice (bitwise equal), with NaN-poisoned memory, within the limits of
gdn_checks. The cases reach every kernel path: dense and packed, odd and zero lengths, initial
states and final-state gradients or none, [V, K] states, GVA and MHA, bf16 and fp16, head dims
64 / 128 / 256 and mixed, the kept chunk states and their recompute, the fused backward walk and
the three-kernel backward, and the intra-card split up to 128k tokens.
"""

import pytest
import torch

from flash_qla_cp import KernelOptions, chunk_gated_delta_rule
from flash_qla_cp.testing import cuda_graph_replay
from gdn_checks import Case, check_case, errors, make_inputs, over_limits, run_op

ODD = (1, 63, 64, 65, 200, 517, 1033)
HALF = torch.float16

CASES = {
    "dense_b2_T300": Case((300, 300), dense=True),
    "varlen_odd": Case(ODD, seed=1),
    "varlen_zero_lengths": Case((0, 130, 0, 64, 1), seed=2),
    "varlen_vfirst": Case((63, 1, 129, 140), state_v_first=True, seed=3),
    "dense_fp16": Case((1000,), dense=True, dtype=HALF, seed=4),
    "dense_k64": Case((700, 700), dense=True, K=64, V=64, seed=5),
    "mha_no_states": Case((777,), dense=True, H=4, HV=4, with_h0=False, with_dht=False, seed=6),
    "tp1_varlen_odd": Case((5000, 3, 7001, 4000, 4097), H=16, HV=32, with_h0=False, with_dht=False, seed=7),
    "tp1_dense_32k": Case((32768,), dense=True, H=16, HV=32, with_h0=False, with_dht=False, seed=8),
    "tp1_varlen_fp16": Case((5000, 3, 7001, 4000), H=16, HV=32, dtype=HALF, with_h0=False, with_dht=False, seed=24),
    "k256_dense": Case((700, 700), dense=True, K=256, V=256, seed=9),
    "k256_varlen_fp16": Case(ODD, K=256, V=256, dtype=HALF, seed=10),
    "k128_v256_varlen": Case(ODD, K=128, V=256, seed=11),
    "k256_v128_fp16": Case((700, 700), dense=True, K=256, V=128, dtype=HALF, seed=12),
    "k64_v256_varlen": Case(ODD, K=64, V=256, seed=13),
    # the intra-card split inside the kernels (forward and backward)
    "split_varlen_p8": Case((16384, 1000, 3001), intra_cp=8, slow_heads=True, seed=14),
    "split_varlen_auto": Case((20000, 77, 4096), intra_cp="auto", slow_heads=True, seed=15),
    # empty sequences between split ones: their one empty partition hands the initial state on as
    # the final state, into the sequence's own row
    "split_varlen_zero_lengths": Case((0, 9000, 0, 3001, 0), intra_cp=4, slow_heads=True, seed=25),
    "split_dense_p4_vfirst": Case((8192, 8192), dense=True, intra_cp=4, state_v_first=True, slow_heads=True, seed=16),
    "split_k64_p16_no_h0": Case((12345,), HV=8, K=64, V=64, intra_cp=16, with_h0=False, slow_heads=True, seed=17),
    "split_tp1_auto": Case((16384 + 77,), H=16, HV=32, intra_cp="auto", slow_heads=True, seed=18),
    "split_k256_auto_stays_whole": Case((5000, 77), K=256, V=256, intra_cp="auto", slow_heads=True, seed=19),
    "split_tp8_dense_128k": Case((131072,), dense=True, intra_cp="auto", with_h0=False, slow_heads=True, seed=20),
    "split_tp8_varlen_128k": Case((100003, 31068, 1), intra_cp="auto", slow_heads=True, seed=21),
    # resets (g = -inf) and gates down to -1e30: floored in the kernels, no NaN, exact to fp32
    "resets_varlen": Case(ODD, resets=True, seed=22),
    "resets_split_auto": Case((20000, 77, 4096), intra_cp="auto", slow_heads=True, resets=True, seed=23),
}

# the kept chunk states (default) and their recompute; the fused walk forced on and off
OPTIONS = {
    "default": {},
    "recompute": {"save_states": False},
    "fused_walk_on": {"kernel_options": KernelOptions(fused_walk="on")},
    "fused_walk_off": {"kernel_options": KernelOptions(fused_walk="off")},
}
QUICK = ("dense_b2_T300", "varlen_odd", "varlen_zero_lengths", "varlen_vfirst", "mha_no_states", "split_varlen_auto",
         "resets_varlen")


@pytest.mark.parametrize("name", list(CASES))
def test_op_within_limits_and_deterministic(name):
    check_case(CASES[name], "cuda", "tilelang")


@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "default"])
@pytest.mark.parametrize("name", QUICK)
def test_op_options_within_limits(name, option):
    check_case(CASES[name], "cuda", "tilelang", **OPTIONS[option])


# a second backward over one forward (retain_graph), after a first whose fused walk wrote dk over
# the kept v residuals
SECOND_BACKWARD = ("varlen_odd", "split_tp1_auto")
SECOND_BACKWARD_OPTIONS = {"backward_twice": True, "kernel_options": KernelOptions(fused_walk="on")}


@pytest.mark.parametrize("name", SECOND_BACKWARD)
def test_a_second_backward_over_one_forward_within_limits(name):
    """The second backward recomputes the residuals (h walk): its gradients are within the limits."""
    case = CASES[name]
    inputs = make_inputs(case)
    want = run_op(case, inputs, "cuda", "torch", reference=True)
    got = run_op(case, inputs, "cuda", "tilelang", **SECOND_BACKWARD_OPTIONS)
    errs = errors(got, want)
    assert not over_limits(errs), errs


@pytest.mark.parametrize("name,save_states", [("varlen_odd", True), ("varlen_vfirst", True),
                                               ("split_tp1_auto", True), ("split_tp1_auto", False)])
def test_compiled_op_within_limits(name, save_states):
    """torch.compile(fullgraph=True) of the op: its custom ops, whose backward takes the chunk
    states the forward kept by handle, or with save_states off runs the forward again (with its
    split, keeping its chunk states); then the eager backward's kernels."""
    case = CASES[name]
    inputs = make_inputs(case)
    want = run_op(case, inputs, "cuda", "torch", reference=True)
    got = run_op(case, inputs, "cuda", "tilelang", op=torch.compile(chunk_gated_delta_rule, fullgraph=True),
                 save_states=save_states)
    errs = errors(got, want)
    assert not over_limits(errs), errs


@pytest.mark.parametrize("name", ["tp1_varlen_odd", "split_tp1_auto"])
def test_a_training_step_replayed_from_a_cuda_graph_is_the_eager_one(name):
    """The op's fwd+bwd (kept chunk states, freed by the backward once its walks are done)
    captured in a CUDA graph: a replay gives the eager step's outputs and gradients bitwise."""
    case = CASES[name]
    inputs = make_inputs(case)
    x = {n: t.to("cuda", case.dtype if n in "qkv" else torch.float32).requires_grad_(True)
         for n, t in inputs.x.items()}
    if case.with_h0:
        x["initial_state"] = inputs.h0.to("cuda", torch.float32).requires_grad_(True)
    grads = (inputs.do.to("cuda", case.dtype), inputs.dfinal.to("cuda") if case.with_dht else None)
    cu = inputs.cu.to("cuda")

    def step():
        for t in x.values():
            t.grad = None
        # (cu_seqlens_cpu: no read-back of the lengths, which a capture refuses)
        o, final = chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=inputs.cu,
                                          backend="tilelang", intra_cp=case.intra_cp)
        torch.autograd.backward([o, final][: 2 if case.with_dht else 1], [g for g in grads if g is not None])
        return o, final

    want = [t.detach().clone() for t in step()] + [t.grad.clone() for t in x.values()]
    replay = cuda_graph_replay(step, warmup=2)
    assert not isinstance(replay, str), replay
    got = [*replay.outputs, *(t.grad for t in x.values())]
    for t in got:
        t.detach().fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    differ = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not differ, differ
