"""Every reader of ``metrics.jsonl`` survives what a crash, a full disk or a resume does to it: a torn last line,
and a file rewritten shorter (rows past the resumed checkpoint dropped). The MLflow calls are recorded instead of
sent: what is checked here is which rows the readers hand on."""

import json

import pytest

from moe_core.analytics.cost import usage_from_events
from moe_core.train.telemetry import JsonlSink, read_jsonl
from tasks import tracking


@pytest.fixture()
def sent(monkeypatch):
    steps = []
    monkeypatch.setattr(
        tracking, "send_metrics", lambda run_id, metrics, step=None, ts=None, **kw: steps.append(step)
    )
    return steps


def write_rows(path, steps, torn=False):
    with path.open("a") as f:
        for step in steps:
            f.write(
                json.dumps({"step": step, "time": 100.0 + step, "loss": 1.0, "tokens": 64.0 * step}) + "\n"
            )
        if torn:
            f.write('{"step": 99, "ti')


def test_readers_leave_a_torn_last_line_out(tmp_path, sent):
    events = tmp_path / "metrics.jsonl"
    write_rows(events, [1, 2, 3], torn=True)
    assert [r["step"] for r in read_jsonl(events)] == [1, 2, 3]
    assert usage_from_events(events, "cpu").tokens == 192
    (tmp_path / tracking.RUN_FILE).write_text(json.dumps({"run_id": "r1", "offline_from_step": 2}))
    assert tracking.sync_events(tmp_path) == ("r1", 2) and sent == [2, 3]


def test_the_event_follower_survives_a_resume_rewriting_the_file(tmp_path, sent):
    events = tmp_path / "metrics.jsonl"
    write_rows(events, [1, 2, 3, 4, 5, 6], torn=True)  # an earlier attempt, killed after step 6; sent then
    follower = tracking.EventFollower("r1", tmp_path)
    sink = JsonlSink(events, start_step=4)  # the resumed run (checkpoint 4) drops rows 5, 6 and the torn tail
    assert [r["step"] for r in read_jsonl(events)] == [1, 2, 3, 4]
    for step in (5, 6, 7, 8):
        sink.log(step, {"loss": 1.0})
    sink.close()
    follower.poll()
    assert sent == [7, 8]  # 5 and 6 went out in the earlier attempt; nothing read from the middle of a line
    write_rows(events, [9])
    follower.poll()
    assert sent == [7, 8, 9]
