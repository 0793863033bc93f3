"""The host-side plan of the intra-card split inside the TileLang kernels (no GPU needed)."""

import pytest
import torch

from flash_qla_cp.kernels.tilelang_common import CHUNK, chunk_table, kernel_operand
from flash_qla_cp.kernels.tilelang_split import auto_partitions, host_chunk_table, plan_split


@pytest.mark.parametrize("cu", [[0, 5, 5, 200, 1000, 1001], [0, 64, 128], [0, 0], [0, 4096 * 3 + 17]])
def test_host_chunk_table_matches_device_builder(cu):
    assert torch.equal(host_chunk_table(cu, "cpu"), chunk_table(torch.tensor(cu)))


def test_plans_are_cached_with_their_device_tensors():
    a = plan_split([0, 64 * 64], HV=4, V=128, parts=4)
    assert plan_split(torch.tensor([0, 64 * 64]).tolist(), HV=4, V=128, parts=4) is a
    t = a.device_tensors("cpu")
    assert t is a.device_tensors("cpu")
    assert t["part_cu"].tolist() == a.part_cu and torch.equal(t["part_chunk_table"], host_chunk_table(a.part_cu, "cpu"))


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


def test_auto_splits_only_when_sms_would_idle():
    # TP8 (4 v-heads, one 32k sequence): 8 CTAs would leave the SMs idle -> split, >= 16 chunks each
    p = auto_partitions(512, num_seqs=1, HV=4, V=128, sms=132)
    assert p > 1 and 512 // p >= 16
    # many heads and sequences already fill the GPU -> no split
    assert auto_partitions(512, num_seqs=8, HV=32, V=128, sms=132) == 1
    # too short to pay for the summary pass
    assert auto_partitions(20, num_seqs=1, HV=4, V=128, sms=132) == 1


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

