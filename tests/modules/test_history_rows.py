"""A cache's conv states as rows in front of their sequences (`modules/history_rows.py`)."""

import torch

from flash_qla_cp.modules.history_rows import HistoryRows
from flash_qla_cp.reference.layer_steps import ProjectionLayout


def test_each_sequence_gets_its_history_rows_in_front_and_drop_gives_the_tokens_back():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # lengths 2, 0, 3
    rows = HistoryRows.of(1, 5, cu, cu, 2, "cpu")
    # extended: h0 h0 t0 t1 | h1 h1 | h2 h2 t2 t3 t4; sources: history rows 0-5, then tokens 6-10
    assert rows.cu_seqlens.tolist() == rows.cu_seqlens_cpu.tolist() == [0, 4, 6, 11]
    assert rows.source.tolist() == [0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 10]
    assert rows.tokens.tolist() == [2, 3, 8, 9, 10]

    lay = ProjectionLayout.qwen3_next(1, 2, 2, 2)
    P = torch.randn(1, 5, lay.width)
    conv_state = torch.randn(3, 2 * 2 + 2 * 2, 4)  # wider than the 2 history rows: its last 2 columns
    ext = rows.extend(P, conv_state, lay)[0]
    assert torch.equal(rows.drop(ext[None], 1, 5), P)
    history = ext[[0, 1, 4, 5, 6, 7]]
    assert torch.equal(history[:, lay.conv_columns()], conv_state[..., 2:].transpose(1, 2).reshape(6, -1))
    gates = torch.cat([lay.a_columns(), lay.b_columns()])
    assert torch.equal(history[:, gates], torch.full((6, gates.numel()), float("-inf")))
    rest = torch.ones(lay.width, dtype=torch.bool)
    rest[lay.conv_columns()] = rest[gates] = False
    assert torch.equal(history[:, rest], torch.zeros(6, int(rest.sum())))


def test_rows_of_a_dense_batch_are_one_sequence_per_row():
    rows = HistoryRows.of(3, 4, None, None, 3, "cpu")
    assert rows.cu_seqlens.tolist() == [0, 7, 14, 21]
    assert rows.tokens.tolist() == [r * 7 + 3 + t for r in range(3) for t in range(4)]


def test_positions_and_last_rows_are_those_of_the_extended_sequences():
    """What the fused layer would otherwise form from the extended cu_seqlens: each row's position
    in its sequence (the conv's taps) and each sequence's last rows (its conv state after the call)."""
    from flash_qla_cp.modules.short_conv import last_inputs
    from flash_qla_cp.reference.layer_steps import token_positions

    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    for rows in (HistoryRows.of(1, 5, cu, cu, 3, "cpu"), HistoryRows.of(2, 1, None, None, 3, "cpu")):
        ext_cu = rows.cu_seqlens
        NT = int(ext_cu[-1])
        assert torch.equal(rows.positions, token_positions(1, NT, ext_cu, "cpu"))
        x = torch.randn(1, NT, 6)
        assert torch.equal(x[0][rows.last_rows].transpose(1, 2), last_inputs(x, ext_cu, 3))


def test_a_batch_shape_s_rows_are_made_once():
    """Decoding repeats one [batch, 1] shape: its rows (every index a launch) are formed once."""
    assert HistoryRows.of(4, 1, None, None, 3, "cpu") is HistoryRows.of(4, 1, None, None, 3, torch.device("cpu"))
    assert HistoryRows.of(4, 1, None, None, 3, "cpu") is not HistoryRows.of(4, 2, None, None, 3, "cpu")
