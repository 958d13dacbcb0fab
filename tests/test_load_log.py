"""The routing load log's one home: its layout encodes and decodes rows, the writer drops a resumed run's
repeated rows, and the reader keeps one memory map per run and closes it when the file grows or it is done."""

import os
from pathlib import Path

import numpy as np
import pytest

from moe_core.train.load_log import SIDECAR, SIDECAR_HEADER, LoadLogLayout, LoadLogReader, LoadLogWriter

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc")


def handles_on(path: Path) -> int:
    """This process's open file descriptors on ``path`` (a memory map holds one too)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            continue
    return n


def test_the_load_log_reader_keeps_one_map_and_closes_it(tmp_path):
    layout = LoadLogLayout((1, 3), 4, has_bias=True)
    writer = LoadLogWriter(tmp_path, layout)
    shares_LE, stats_LS, bias_LE = np.full((2, 4), 0.25), np.arange(6.0).reshape(2, 3), -np.ones((2, 4))
    writer.append(1, 10.0, shares_LE, stats_LS, bias_LE)
    log_file = (tmp_path / SIDECAR).resolve()
    before = handles_on(log_file)  # the writer's own
    reader = LoadLogReader(tmp_path)
    for step in range(2, 6):
        got_layout, rows = reader.rows()
        assert got_layout == layout and rows.shape == (step - 1, layout.row_floats)
        writer.append(step, 10.0 * step, shares_LE, stats_LS, bias_LE)
        del rows
        assert handles_on(log_file) <= before + 1  # a grown file: the old map is closed, not left to GC
    columns = layout.layer_columns(reader.rows()[1], 3)
    np.testing.assert_array_equal(columns["frac"], np.full((5, 4), 0.25, dtype=np.float32))
    assert columns["entropy"].tolist() == [4.0] * 5 and columns["bias"].tolist() == [[-1.0] * 4] * 5
    np.testing.assert_array_equal(reader.read(3, 10)[:, 0], [4, 5])  # a plain read of whole rows only
    with open(tmp_path / SIDECAR, "ab") as f:
        f.write(b"\0" * 6)  # a torn row is never seen
    assert reader.rows()[1].shape[0] == 5
    del columns  # views into the map: it closes when they go
    reader.close()
    assert handles_on(log_file) == before
    writer.close()
    with pytest.raises(KeyError, match="not an MoE layer"):
        layout.layer_columns(np.zeros((1, layout.row_floats), np.float32), 2)


def test_the_layout_reads_back_its_saved_header_and_refuses_a_wrong_one(tmp_path):
    layout = LoadLogLayout((0, 5, 7), 16, has_bias=False)
    header = layout.header()
    assert header["row_floats"] == 2 + 3 * (16 + 3) and header["per_layer"]["entropy"] == 17
    assert LoadLogLayout.from_header(header) == layout
    with pytest.raises(ValueError, match="row_floats 99 does not match"):
        LoadLogLayout.from_header({**header, "row_floats": 99}, tmp_path / SIDECAR_HEADER)
    with pytest.raises(ValueError, match="not a routing load-log header"):
        LoadLogLayout.from_header({"layers": [0]}, tmp_path / SIDECAR_HEADER)
