"""The per-qk-head sum of the fused backward walk's per-v-head dq / dk parts (GVA)."""

import pytest
import torch

from flash_qla_cp.reference.kernel_steps import sum_v_head_parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_sum_v_head_parts_is_torch_sum_bitwise(dtype, group):
    gen = torch.Generator().manual_seed(group)
    parts = (4 * torch.randn(1, 333, 2, group, 64, generator=gen)).to(dtype)
    out = torch.full((1, 333, 2, 64), float("nan"), dtype=dtype)
    sum_v_head_parts(parts, out)
    assert torch.equal(out, torch.sum(parts, dim=3))
    # one rounding of the exact sum, as torch.sum (fp32 accumulation) gives
    assert torch.equal(out, parts.double().sum(3).to(dtype))
