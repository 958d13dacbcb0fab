"""`moe-lab train --dashboard` and `moe-lab dashboard` as a user runs them."""

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dashboard.cli import DashboardError, start_beside

ROOT = Path(__file__).parents[1]


def test_start_beside_serves_and_refuses_an_open_host_without_token(tmp_path, monkeypatch):
    monkeypatch.delenv("MOE_LAB_DASHBOARD_TOKEN", raising=False)
    with pytest.raises(DashboardError, match="--token"):
        start_beside([tmp_path], host="0.0.0.0")
    proc, url = start_beside([tmp_path], token="s3cret")
    try:
        assert url.endswith("?token=s3cret")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url.split("?")[0] + "api/runs")
        assert err.value.code == 401
        assert b'"runs":[]' in urllib.request.urlopen(url.split("?")[0] + "api/runs?token=s3cret").read()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.slow
def test_train_with_dashboard_prints_its_url_and_stops_it(tmp_path):
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_lab",
            "train",
            "--out",
            str(out),
            "--preset",
            "mixtral-tiny",
            "--dashboard",
            "--set",
            "steps=3",
            "--set",
            "data.source=synthetic",
            "--set",
            "data.seq_len=32",
            "--set",
            "batch_size=4",
            "--set",
            "log.progress=off",
            "--set",
            "checkpoint.export=false",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "live dashboard" in x)
    url = line.split("live dashboard ")[1].strip()
    assert url.startswith("http://127.0.0.1:")
    assert (out / "routing_loads.f32").stat().st_size > 0
    with pytest.raises(urllib.error.URLError):  # not a terminal: the dashboard stops with the training
        urllib.request.urlopen(url + "api/runs", timeout=5)
