"""Fixtures shared by the CPU tests."""

import pathlib
import sys

import pytest

# the README's main job (examples/hybrid_lm) is imported by the training and Qwen-swap tests
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))


@pytest.fixture
def save_states_requests(monkeypatch):
    """The save_states value of every `ops.chunk_gated_delta_rule_fwd` call made in the test
    (the op and the CP engine both call it), in order; the calls themselves run unchanged."""
    from flash_qla_cp import ops

    asked = []
    real_fwd = ops.chunk_gated_delta_rule_fwd

    def spy(*args, save_states=False, **kw):
        asked.append(save_states)
        return real_fwd(*args, save_states=save_states, **kw)

    monkeypatch.setattr(ops, "chunk_gated_delta_rule_fwd", spy)
    return asked
