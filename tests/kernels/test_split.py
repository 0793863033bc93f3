"""The host-side plan of the intra-card split inside the TileLang kernels (no GPU needed)."""

import pytest
import torch

from flash_qla_cp.constants import CHUNK, WARMUP_LOG_DECAY
from flash_qla_cp.kernels.hopper.common import ordered_block
from flash_qla_cp.kernels.runtime import kernel_operand
from flash_qla_cp.kernels.split import LONG_WALK_SLACK, auto_partitions, balance_partitions, plan_split
from flash_qla_cp.kernels.tables import chunk_offsets, chunk_table, host_chunk_offsets, host_chunk_table, walk_order
from flash_qla_cp.parallel.transition import segment_transitions
from flash_qla_cp.reference.chunked import chunk_gated_delta_rule_torch
from flash_qla_cp.reference.kernel_steps import dh_warmup_chunks, warmup_starts
from flash_qla_cp.testing import chunk_local_cumsum, make_gdn_inputs


@pytest.mark.parametrize("cu", [[0, 5, 5, 200, 1000, 1001], [0, 64, 128], [0, 0], [0, 4096 * 3 + 17]])
def test_host_chunk_table_matches_device_builder(cu):
    assert torch.equal(host_chunk_table(cu, "cpu"), chunk_table(torch.tensor(cu)))
    # the plan's offsets stand in for the device-computed ones (forward and backward)
    assert torch.equal(host_chunk_offsets(cu, "cpu"), chunk_offsets(torch.tensor(cu)))


@pytest.mark.parametrize("cu", [[0, 4199, 9832, 11880, 14158, 17361, 22287, 26454, 32768], [0, 5, 5, 70, 70, 75],
                                [0, 64, 128, 192]])
@pytest.mark.parametrize("HV", [1, 4, 32])
def test_walk_grids_start_the_longest_sequences_first_and_cover_every_block_once(cu, HV):
    order = walk_order(torch.tensor(cu, dtype=torch.int32))
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    # longest first, ties in index order
    assert order.dtype == torch.int32 and order.tolist() == sorted(range(len(lengths)), key=lambda n: -lengths[n])
    N = len(lengths)
    # the grid's blocks in launch order: sequence index fastest, then the v-head (grid (.., N, HV))
    blocks = [ordered_block(order.tolist(), bn, bh, N, HV) for bh in range(HV) for bn in range(N)]
    assert sorted(blocks) == [(n, h) for n in range(N) for h in range(HV)]
    started = [lengths[n] for n, _ in blocks]
    assert started == sorted(started, reverse=True)
    # equal lengths keep the sequences in their own order (a dense batch's grid is unchanged)
    if len(set(lengths)) == 1:
        assert [n for n, _ in blocks[::HV]] == list(range(N))


def test_plans_are_cached_with_their_device_tensors():
    a = plan_split([0, 64 * 64], HV=4, V=128, parts=4)
    assert plan_split(torch.tensor([0, 64 * 64]).tolist(), HV=4, V=128, parts=4) is a
    t = a.device_tensors("cpu")
    assert t is a.device_tensors("cpu")
    assert t["part_cu"].tolist() == a.part_cu and torch.equal(t["part_chunk_table"], host_chunk_table(a.part_cu, "cpu"))
    assert torch.equal(t["part_order"], walk_order(t["part_cu"])) and t["seq_order"].tolist() == [0]


@pytest.mark.parametrize("parts", [1, 3, 8, "auto"])
def test_partitions_tile_each_sequence_at_chunk_boundaries(parts):
    cu = [0, 1000, 1000, 9000, 9001, 9001 + 64 * 40 + 5]
    plan = plan_split(cu, HV=4, V=128, parts=parts, sms=132)
    assert plan.part_cu[0] == 0 and plan.part_cu[-1] == cu[-1]
    for n in range(len(cu) - 1):
        first, last = plan.seq_parts[n], plan.seq_parts[n + 1] - 1
        assert plan.part_cu[first] == cu[n] and plan.part_cu[last + 1] == cu[n + 1]
        for p in range(first, last + 1):
            a, b = plan.part_cu[p], plan.part_cu[p + 1]
            assert b >= a
            if p < last:  # only a sequence's last partition may end inside a chunk
                assert (b - cu[n]) % CHUNK == 0 and b > a
        count = last - first + 1
        chunks = -(-(cu[n + 1] - cu[n]) // CHUNK)
        if parts != "auto":
            assert count == max(1, min(parts, chunks))
        split = set(range(first, last + 1)) <= set(plan.split_parts)
        assert split == (count > 1)
    assert plan.first_parts() == plan.seq_parts[:-1]
    assert plan.last_parts() == [p - 1 for p in plan.seq_parts[1:]]


def test_auto_partitions_aim_at_one_walk_per_sm():
    # TP8 (4 v-heads), one 32k sequence (512 chunks): 32 partitions of 16 chunks (128 walks);
    # at TP1 (32 v-heads) 4 x 32 walks fill 132 SMs
    assert auto_partitions(512, num_seqs=1, HV=4, V=128, sms=132) == 32
    assert auto_partitions(512, num_seqs=1, HV=32, V=128, sms=132) == 4
    # 128k: at TP8 32 x 4 walks, at TP1 as for 32k
    assert auto_partitions(2048, num_seqs=1, HV=4, V=128, sms=132) == 32
    assert auto_partitions(2048, num_seqs=1, HV=32, V=128, sms=132) == 4
    # one 8k sequence (128 chunks) at TP1: 4 partitions of 32 chunks; four of them fill the SMs
    assert auto_partitions(128, num_seqs=1, HV=32, V=128, sms=132) == 4
    assert auto_partitions(128, num_seqs=4, HV=32, V=128, sms=132) == 1
    # many sequences already fill the GPU; short sequences are not cut below 16 chunks
    assert auto_partitions(512, num_seqs=8, HV=32, V=128, sms=132) == 1
    assert auto_partitions(20, num_seqs=1, HV=4, V=128, sms=132) == 1
    assert auto_partitions(40, num_seqs=1, HV=4, V=128, sms=132) == 2
    assert auto_partitions(64, num_seqs=1, HV=4, V=128, sms=132) == 4
    # a wider state is walked in 128-column slices: V = 256 counts twice
    assert auto_partitions(512, num_seqs=1, HV=32, V=256, sms=132) == 2
    # a smaller GPU gets fewer partitions
    assert auto_partitions(512, num_seqs=1, HV=32, V=128, sms=66) == 2


def test_auto_plan_matches_auto_partitions():
    # two sequences (walks of 2 x 4 v-heads): 32k -> 16 partitions, 8k -> 8
    plan = plan_split([0, 32768, 32768 + 8192], HV=4, V=128, parts="auto", sms=132)
    assert plan.seq_parts == [0, 16, 24] and plan.split_parts == list(range(24))


def test_auto_plan_cuts_a_long_document_among_short_ones():
    # TP1: one 24k document and eight of 1k. 288 walks unsplit: the fill rule cuts nothing, and
    # the long document's 375 chunk steps would take 3x the batch's even share per SM (122)
    cu = [0, 24000] + [24000 + 1024 * i for i in range(1, 9)]
    plan = plan_split(cu, HV=32, V=128, parts="auto", sms=132)
    counts = [plan.seq_parts[n + 1] - plan.seq_parts[n] for n in range(len(cu) - 1)]
    assert counts == [4] + [1] * 8
    steps = [-(-(b - a) // CHUNK) for a, b in zip(plan.part_cu, plan.part_cu[1:])]
    assert max(steps) <= LONG_WALK_SLACK * 32 * sum(steps) / 132
    # even batches are left as the fill rule has them (the bench's 8 uneven documents in 32k too)
    assert plan_split([0, 8192, 16384, 24576, 32768], HV=32, V=128, parts="auto", sms=132).is_trivial
    bench_cu = [0, 4199, 9832, 11880, 14158, 17361, 22287, 26454, 32768]
    assert plan_split(bench_cu, HV=32, V=128, parts="auto", sms=132).is_trivial
    assert balance_partitions(375, 122.0) == 4
    # never aimed below two minimal partitions: short walks on a busy GPU gain nothing from more cuts
    assert balance_partitions(100, 10.0) == 4 and balance_partitions(64, 1.0) == 2


def _gates(T, rates, seed):
    gen = torch.Generator().manual_seed(seed)
    soft = torch.nn.functional.softplus(torch.randn(1, T, len(rates), generator=gen, dtype=torch.float64))
    return -torch.tensor(rates, dtype=torch.float64) * soft


def test_warmup_starts_are_the_last_chunk_with_enough_decay():
    cu = [0, 64 * 37 + 5, 64 * 37 + 5, 64 * 37 + 5 + 64 * 20]  # with an empty sequence
    plan = plan_split(cu, HV=3, V=128, parts=3)
    assert plan.num_parts == 7
    # slow (about -0.7 per chunk: several chunks of warm-up), fast, and g = 0 (never decays)
    g = _gates(cu[-1], [0.03, 1.0, 0.0], seed=0)
    starts = warmup_starts(chunk_local_cumsum(g, cu).float(), plan)
    assert starts.shape == (plan.num_parts, 3) and starts.dtype == torch.int32
    for p in range(plan.num_parts):
        a, b = plan.part_cu[p], plan.part_cu[p + 1]
        for h in range(3):
            # brute force: decay from chunk c to the partition's end, c counted from the partition start
            tails = [g[0, a + c * CHUNK : b, h].sum().item() for c in range(-(-(b - a) // CHUNK))]
            ok = [c for c, t in enumerate(tails) if t < WARMUP_LOG_DECAY]
            assert starts[p, h].item() == (max(ok) if ok else -1), (p, h)
    assert (starts[:, 2] == -1).all()  # g = 0: no shortcut
    nonempty = torch.tensor([b > a for a, b in zip(plan.part_cu, plan.part_cu[1:])])
    assert (starts[nonempty, 1] >= 0).all() and (starts[nonempty, 1] > 0).any() and (starts[~nonempty] == -1).all()
    assert (starts[:, 0] >= 1).any() and (starts[:, 0] == -1).any()  # slow: long warm-ups, or none


def test_dh_warmup_covers_the_first_chunks_until_enough_decay():
    """The backward's first dh walk per partition: the fewest leading chunks whose decays sum
    below the threshold (all chunks if they never do, none for an empty partition)."""
    cu = [0, 64 * 37 + 5, 64 * 37 + 5, 64 * 37 + 5 + 64 * 20]
    plan = plan_split(cu, HV=3, V=128, parts=3)
    g = _gates(cu[-1], [0.03, 1.0, 0.0], seed=1)
    walk = dh_warmup_chunks(chunk_local_cumsum(g, cu).float(), plan)
    assert walk.shape == (plan.num_parts, 3) and walk.dtype == torch.int32
    for p in range(plan.num_parts):
        a, b = plan.part_cu[p], plan.part_cu[p + 1]
        n = -(-(b - a) // CHUNK)
        for h in range(3):
            heads = [g[0, a : min(a + (w + 1) * CHUNK, b), h].sum().item() for w in range(n)]
            ok = [w for w, t in enumerate(heads) if t < WARMUP_LOG_DECAY]
            assert walk[p, h].item() == (min(ok) + 1 if ok else n), (p, h)
    assert (walk[:, 1] <= 1).all() and (walk[:, 0] > 1).any()


def test_warmup_walk_gives_the_partition_summary():
    """h from a zero state over the chunks from the warm-up start equals the whole partition's h
    (the dropped part is damped below exp(WARMUP_LOG_DECAY)), and M is that small too."""
    T, HV = 64 * 48, 2
    x = make_gdn_inputs(seq_len=T, num_heads=1, num_v_heads=HV, head_k_dim=32, head_v_dim=32,
                        strong_decay_heads=0, zero_gate_heads=0, generator=torch.Generator().manual_seed(3))
    x["g"] = _gates(T, [0.004, 0.02], seed=4)  # warm-ups of a few to tens of chunks
    plan = plan_split([0, T], HV=HV, V=32, parts=2)
    starts = warmup_starts(chunk_local_cumsum(x["g"], [0, T]).float(), plan)
    checked = 0
    for p in range(plan.num_parts):
        a, b = plan.part_cu[p], plan.part_cu[p + 1]
        sl = {n: t[:, a:b] for n, t in x.items()}
        M, h = segment_transitions(sl["k"], sl["v"], sl["g"], sl["beta"], cu_seqlens=torch.tensor([0, b - a]))
        for hv in range(HV):
            s = starts[p, hv].item()
            if s < 0:
                continue
            tl = {n: t[:, a + s * CHUNK : b] for n, t in x.items()}
            _, h_warm = segment_transitions(tl["k"], tl["v"], tl["g"], tl["beta"],
                                            cu_seqlens=torch.tensor([0, b - a - s * CHUNK]))
            scale = h[0, hv].norm()
            assert (h_warm[0, hv] - h[0, hv]).norm() <= 1e-6 * scale
            assert M[0, hv].norm() <= 1e-6
            checked += 1
    assert checked >= 2 and (starts > 0).any()


def test_trivial_plan_when_nothing_is_cut():
    assert plan_split([0, 100, 300], HV=32, V=128, parts="auto").is_trivial
    assert not plan_split([0, 64 * 64], HV=4, V=128, parts=4).is_trivial


def test_unsplit_plan_gives_the_dense_batch_chunk_table():
    """The TileLang backward takes a dense batch's chunk table from a cached one-partition plan."""
    B, T = 3, 1000
    plan = plan_split([b * T for b in range(B + 1)], HV=32, V=128, parts=1)
    assert plan.is_trivial
    want = chunk_table(torch.arange(B + 1, dtype=torch.int32) * T)
    assert torch.equal(plan.device_tensors("cpu")["seq_chunk_table"], want)


def test_kernel_operands_are_copied_only_when_misaligned():
    # an all_gather body after a one-element flag sits 4 bytes into its buffer: the kernels'
    # 16-byte vector/TMA loads fault on it (seen on the H200), so it must be copied
    buf = torch.arange(1 + 2 * 4 * 4, dtype=torch.float32)
    shifted = buf[1:].view(2, 4, 4)
    fixed = kernel_operand(shifted)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, shifted)
    aligned = buf[4:20].view(4, 4)  # 16 bytes in: used as it is
    assert kernel_operand(aligned).data_ptr() == aligned.data_ptr()
    strided = torch.zeros(4, 8)[:, ::2]
    assert kernel_operand(strided).is_contiguous()



def test_dh_warmup_walk_gives_the_gradient_at_the_partition_start():
    """The gradient reaching a partition's start from its outputs (zero gradient at its end) is
    the same when only the outputs of its first dh_warmup_chunks chunks are kept."""
    T, HV = 64 * 40, 2
    x = make_gdn_inputs(seq_len=T, num_heads=1, num_v_heads=HV, head_k_dim=32, head_v_dim=32,
                        strong_decay_heads=0, zero_gate_heads=0, generator=torch.Generator().manual_seed(5))
    x["g"] = _gates(T, [0.004, 0.02], seed=6)
    plan = plan_split([0, T], HV=HV, V=32, parts=2)
    walk = dh_warmup_chunks(chunk_local_cumsum(x["g"], [0, T]).float(), plan)
    do = torch.randn(1, T, HV, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    checked = 0
    for p in range(plan.num_parts):
        a, b = plan.part_cu[p], plan.part_cu[p + 1]
        sl = {n: t[:, a:b] for n, t in x.items()}

        def grad_at_start(upto):
            s_in = torch.zeros(1, HV, 32, 32, dtype=torch.float64, requires_grad=True)
            o, _ = chunk_gated_delta_rule_torch(sl["q"], sl["k"], sl["v"], sl["g"], sl["beta"], 32**-0.5, s_in)
            mask = torch.zeros(1, b - a, HV, 1, dtype=torch.float64)
            for hv in range(HV):
                mask[:, : upto[hv] * CHUNK, hv] = 1
            (o * do[:, a:b] * mask).sum().backward()
            return s_in.grad[0]

        n = -(-(b - a) // CHUNK)
        full = grad_at_start([n] * HV)
        short = grad_at_start(walk[p].tolist())
        for hv in range(HV):
            if walk[p, hv] < n:
                assert (short[hv] - full[hv]).norm() <= 1e-6 * full[hv].norm()
                checked += 1
    assert checked >= 2
