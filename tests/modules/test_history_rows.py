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
