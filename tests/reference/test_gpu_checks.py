"""The GPU tests' checks (tests/gpu/gdn_checks.py) run here on the torch backend: a check that is
broken, or that cannot fail, shows up before a GPU session is spent on it."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpu"))

from gdn_checks import Case, check_case, errors, make_inputs, over_limits, run_op  # noqa: E402

SMALL = {
    "varlen_odd_zero": Case((1, 63, 0, 65, 130), H=1, HV=2, K=16, V=16),
    "dense_vfirst_no_dht": Case((70, 70), dense=True, H=1, HV=2, K=16, V=8, state_v_first=True, with_dht=False),
    "torch_split": Case((300,), H=1, HV=2, K=16, V=16, intra_cp=3, slow_heads=True),
    "resets": Case((1, 63, 0, 65, 330), H=1, HV=3, K=16, V=16, resets=True),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_checks_pass_on_the_torch_backend(name):
    errs = check_case(SMALL[name], "cpu", "torch")
    case = SMALL[name]
    assert ("dh0" in errs) == case.with_h0 and all(e < 5e-3 for e in errs.values())


def test_checks_fail_on_a_wrong_result_and_on_nan():
    case = SMALL["varlen_odd_zero"]
    inputs = make_inputs(case)
    want = run_op(case, inputs, "cpu", "torch", reference=True)
    got = run_op(case, inputs, "cpu", "torch")
    assert not over_limits(errors(got, want))
    wrong = dict(got, dg=got["dg"] * 1.05)
    assert set(over_limits(errors(wrong, want))) == {"dg"}
    nan = dict(got, o=got["o"].clone().index_fill_(1, torch.tensor([3]), float("nan")))
    assert set(over_limits(errors(nan, want))) == {"o"}
