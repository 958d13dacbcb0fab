"""How the dashboard reads a run fast, held equal to the plain way: event lines with the skipped per-layer keys
cut out of the bytes (both writers' spacing, NaN strings, a key last in its line, a torn line), parsed in
blocks; load-log buckets summed as a reshaped view."""

import json

import numpy as np
import orjson

from dashboard import runs
from dashboard.runs import EventTail, downsample_rows


def test_event_tail_cuts_skipped_keys_like_a_plain_parse(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "PARSE_BLOCK", 300)  # many blocks, cut at line ends
    rows = []
    for step in range(1, 41):
        row = {"step": step, "time": 1.5 + step, "loss": 3.0 / step}
        row.update({f"moe/layer_{i}/entropy": 0.1 * i for i in range(3)})
        row["moe/layer_0/expert_1_frac"] = "nan"
        if step % 3:
            row["alert/drops/layer_0"] = 0.5
        if step % 2:
            row["moe/layer_9/drop_rate"] = 0.25  # a skipped key last in its line
        rows.append(row)
    dumps = [json.dumps, lambda r: orjson.dumps(r).decode()]  # the trainer's JsonlSink, and orjson spacing
    text = "".join(dumps[r["step"] % 2](r) + "\n" for r in rows) + '{"step": 41, "loss": 1.0, "moe/la'
    (tmp_path / "metrics.jsonl").write_text(text)
    tail = EventTail(tmp_path / "metrics.jsonl", tmp_path, skip_prefixes=("moe/",))
    got = tail.poll()
    want = [
        {k: float(v) if k == "step" else v for k, v in r.items() if not k.startswith("moe/")} for r in rows
    ]
    assert got == want  # the torn last line is left for the next poll
    assert tail.columns["loss"].values == [3.0 / s for s in range(1, 41)]
    assert set(tail.alerts) == {"alert/drops/layer_0"}


def test_bucket_means_equal_a_plain_loop_with_nan_and_a_short_last_bucket():
    rng = np.random.default_rng(0)
    rows_NC = rng.random((103, 7)).astype(np.float32)
    rows_NC[40, 2] = np.nan
    edges, means = downsample_rows(rows_NC, 10)
    assert len(edges) <= 10 and edges[0] == 0
    bounds = [*edges.tolist(), 103]
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        np.testing.assert_allclose(means[b], rows_NC[lo:hi].astype(np.float64).mean(0), rtol=1e-6)
    assert np.isnan(means[np.searchsorted(edges, 40, side="right") - 1, 2])
    edges, means = downsample_rows(rows_NC[:5], 10)  # fewer rows than points: the rows themselves
    np.testing.assert_array_equal(means, rows_NC[:5])
