"""cu_seqlens' host copy: made once per tensor and kept while the tensor is unchanged."""

import torch

from flash_qla_cp.modules.offsets_read_back import OffsetsReadBack


def test_the_same_unchanged_tensor_shares_one_copy():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    first = OffsetsReadBack.of(cu)
    assert OffsetsReadBack.of(cu) is first and first.arrived()
    assert first.result().tolist() == [0, 5, 9] and first.result() is not cu


def test_an_in_place_change_or_a_new_tensor_makes_a_new_copy():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    first = OffsetsReadBack.of(cu)
    cu[1:2].fill_(7)  # through a view: the version counter is shared
    changed = OffsetsReadBack.of(cu)
    assert changed is not first and changed.result().tolist() == [0, 7, 9]
    assert first.result().tolist() == [0, 5, 9]  # an earlier copy is not the caller's tensor
    equal_values = torch.tensor([0, 7, 9], dtype=torch.int32)
    assert OffsetsReadBack.of(equal_values) is not changed


def test_inference_tensors_are_read_back_each_time():
    with torch.inference_mode():
        cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    assert OffsetsReadBack.of(cu) is not OffsetsReadBack.of(cu)


def test_a_dead_tensor_leaves_nothing_to_match():
    """A new tensor at a dead one's id and version is not taken for it."""
    for _ in range(20):
        cu = torch.tensor([0, 3], dtype=torch.int32)
        kept = OffsetsReadBack.of(cu)
        del cu
        other = torch.tensor([0, 4], dtype=torch.int32)
        assert OffsetsReadBack.of(other).result().tolist() == [0, 4]
        assert kept.result().tolist() == [0, 3]
