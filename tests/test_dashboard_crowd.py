"""The dashboard under a crowd: many live streams on one run share one reader, get every row once and in
order, and leave no file open behind them."""

import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dashboard.runs import RunData
from dashboard.server import create_app
from moe_core.train.load_log import SIDECAR, LoadLogLayout, LoadLogWriter, read_sidecar
from tests.dashboard_helpers import serve
from tests.test_load_log import handles_on

LAYERS, EXPERTS, CLIENTS, POLL = (0, 2), 4, 20, 0.05


def append_steps(run: Path, writer: LoadLogWriter, steps: range) -> None:
    """Rows as the trainer writes them: an event-file line and a load-log row per step."""
    rng = np.random.default_rng(steps.start)
    with open(run / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(
                json.dumps({"step": step, "time": time.time(), "loss": 5.0 / step, "tokens": 64.0 * step})
            )
            f.write("\n")
            shares_LE = rng.dirichlet(np.ones(EXPERTS), len(LAYERS))
            writer.append(step, 64.0 * step, shares_LE, np.full((len(LAYERS), 3), 0.5))
        f.flush()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc")
def test_many_streams_share_one_reader_get_every_row_and_close_their_files(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "crowd"
    run.mkdir(parents=True)
    writer = LoadLogWriter(run, LoadLogLayout(LAYERS, EXPERTS, has_bias=False))
    append_steps(run, writer, range(1, 6))
    refreshes = []
    original = RunData.refresh
    monkeypatch.setattr(RunData, "refresh", lambda self: refreshes.append(1) or original(self))
    app = create_app([tmp_path / "runs"], poll_seconds=POLL)
    log_file = (run / SIDECAR).resolve()
    with serve(app) as url:
        rid = json.load(urllib.request.urlopen(url + "/api/runs"))["runs"][0]["id"]
        json.load(urllib.request.urlopen(f"{url}/api/runs/{rid}/routing?layer=2"))  # the run's own map
        baseline = handles_on(log_file)
        received = [[] for _ in range(CLIENTS)]
        connected = [threading.Event() for _ in range(CLIENTS)]
        stop = threading.Event()

        def listen(i):
            with urllib.request.urlopen(f"{url}/api/runs/{rid}/stream?since=5", timeout=30) as resp:
                for raw in resp:
                    connected[i].set()
                    line = raw.decode()
                    if line.startswith("data: "):
                        received[i].append(json.loads(line[6:]))
                    if stop.is_set():
                        return

        threads = [threading.Thread(target=listen, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        assert all(c.wait(30) for c in connected)
        feeds = app.state.feeds.feeds
        assert list(feeds) == [rid] and len(feeds[rid].subscribers) == CLIENTS  # one reader for all

        refreshes.clear()
        t0 = time.monotonic()
        time.sleep(1.0)
        polls = (time.monotonic() - t0) / POLL
        assert len(refreshes) <= 1.5 * polls + 5, (len(refreshes), polls)  # one read per poll, not per client
        assert handles_on(log_file) <= baseline + 1  # no map kept per stream

        for start in range(6, 36, 10):  # rows while the crowd watches, in bursts
            append_steps(run, writer, range(start, start + 10))
            time.sleep(3 * POLL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
            any(r["step"] == 35 for u in got for r in u["routing"]) for got in received
        ):
            time.sleep(0.05)
        stop.set()
        append_steps(run, writer, range(36, 37))  # a last row wakes each client to return
        for t in threads:
            t.join(10)
        for got in received:  # every row, once, in order, in both parts of the stream
            assert [r["step"] for u in got for r in u["rows"]][:30] == list(range(6, 36))
            routing = [r for u in got for r in u["routing"]][:30]
            assert [r["step"] for r in routing] == list(range(6, 36))
            assert all(len(r["frac"]) == len(LAYERS) and len(r["frac"][0]) == EXPERTS for r in routing)
        np.testing.assert_allclose(
            received[0][0]["routing"][0]["frac"],
            read_sidecar(run)[1][5, 2:].reshape(len(LAYERS), -1)[:, :EXPERTS],
            rtol=1e-6,
        )

        deadline = time.monotonic() + 15  # the clients left: the feed stops, no file stays open
        while time.monotonic() < deadline and (feeds or handles_on(log_file) > baseline):
            time.sleep(0.05)
        assert not feeds
        assert handles_on(log_file) == baseline
    writer.close()
