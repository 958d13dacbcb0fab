"""The training process runner: a failure or cancellation stops the whole process group, grandchildren too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_core.train.cli import run_launcher
from tasks.process import TrainingProcessDied, run_group, run_until_stopped


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here and in the children started here, as in a terminal: a shell that
    runs pytest as a background job (``pytest &`` in a script) starts it with SIGINT ignored, which every child
    inherits, and then nothing these tests send with SIGINT arrives."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_interrupting_the_wait_stops_children_and_grandchildren(tmp_path):
    pids = tmp_path / "pids"
    script = f"import os, subprocess, time; c = subprocess.Popen(['sleep', '60']); open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(60)"

    class Cancelled(BaseException):  # what Prefect raises in the flow when a run is cancelled
        pass

    def cancel_once_started():
        if pids.is_file() and pids.read_text():
            raise Cancelled

    with pytest.raises(Cancelled):
        run_group([sys.executable, "-c", script], tmp_path, cancel_once_started, poll_s=0.1)
    parent, grandchild = map(int, pids.read_text().split())
    assert not _alive(parent) and not _alive(grandchild)


def test_a_failing_process_raises_with_the_exit_status(tmp_path):
    with pytest.raises(TrainingProcessDied, match="exited with 3"):
        run_group([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, poll_s=0.1)


# A stand-in for the MLflow server `moe-lab ui` starts (which takes over a minute to come up on a busy 2-core
# machine): `python -m mlflow` finds it first on the server's PYTHONPATH. Like uvicorn it has a worker of its
# own; it writes both pids once started.
SERVER = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(os.environ["STAND_IN_PIDS"], "w").write(f"{os.getpid()} {worker.pid}")
time.sleep(120)
"""
UI = """
import os, sys
import tasks.tracking  # the real mlflow, loaded in this process before the stand-in goes on the path
from moe_lab.cli import main

os.environ["PYTHONPATH"] = sys.argv[1] + os.pathsep + os.environ["PYTHONPATH"]
sys.exit(main(["ui", "--port", "1"]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_ui_stopped_by_a_signal_stops_the_server_it_started_and_its_workers(tmp_path, signum):
    stand_in = tmp_path / "stand_in"
    (stand_in / "mlflow").mkdir(parents=True)
    (stand_in / "mlflow" / "__init__.py").write_text("")
    (stand_in / "mlflow" / "__main__.py").write_text(SERVER)
    pids = tmp_path / "pids"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "MOE_LAB_HOME": str(tmp_path / "home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "STAND_IN_PIDS": str(pids),
    }
    ui = subprocess.Popen(
        [sys.executable, "-c", UI, str(stand_in)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (pids.is_file() and pids.read_text()) and ui.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ui.poll() is None, ui.communicate()[0][-2000:]
    ui.send_signal(signum)  # to `moe-lab ui` alone, as `kill` or a process manager sends it
    output = ui.communicate(timeout=60)[0]
    server, worker = map(int, pids.read_text().split())
    try:
        assert ui.returncode == 128 + signum, output[-2000:]
        assert not _alive(server) and not _alive(worker)
    finally:
        for pid in (server, worker):  # what the old code left running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


class _SignalledWhileStarting(subprocess.Popen):
    """`subprocess.Popen` that gets a stop signal after its child started and before it returns: what a Ctrl-C
    at the wrong moment (or a test sending its signal as soon as the server is up) does."""

    signum = signal.SIGINT
    started: list[int] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).started.append(self.pid)
        signal.raise_signal(type(self).signum)
        time.sleep(0.2)  # the handler runs here, inside the constructor, if nothing holds the signal


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_while_the_server_starts_still_stops_it(monkeypatch, signum):
    monkeypatch.setattr(_SignalledWhileStarting, "signum", signum)
    monkeypatch.setattr(_SignalledWhileStarting, "started", [])
    monkeypatch.setattr(subprocess, "Popen", _SignalledWhileStarting)
    try:
        code = run_until_stopped([sys.executable, "-c", "import time; time.sleep(60)"], grace_s=5)
    except (KeyboardInterrupt, SystemExit) as escaped:  # before: raised inside Popen, the server left running
        code = f"escaped: {escaped!r}"
    (pid,) = _SignalledWhileStarting.started
    try:
        assert code == 128 + signum and not _alive(pid)
    finally:
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_ctrl_c_while_the_training_process_starts_stops_its_group(monkeypatch, tmp_path):
    monkeypatch.setattr(_SignalledWhileStarting, "started", [])
    monkeypatch.setattr(subprocess, "Popen", _SignalledWhileStarting)
    try:
        with pytest.raises(
            KeyboardInterrupt
        ):  # raised in the wait, where the group is stopped on the way out
            run_group([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, poll_s=0.05)
        (pid,) = _SignalledWhileStarting.started
        assert not _alive(pid)
    finally:
        for pid in _SignalledWhileStarting.started:
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_torchrun_launcher_keeps_a_stop_signal_that_lands_while_torchrun_starts(monkeypatch, signum):
    """`moe-lab train --nproc`'s launcher (`moe_core.train.cli.run_launcher`): its handlers are in place before
    torchrun starts, so the signal is neither lost nor fatal to the launcher alone; a SIGTERM is passed on."""
    monkeypatch.setattr(_SignalledWhileStarting, "signum", signum)
    monkeypatch.setattr(_SignalledWhileStarting, "started", [])
    monkeypatch.setattr(subprocess, "Popen", _SignalledWhileStarting)
    # a stand-in for torchrun: ends 1 s after a Ctrl-C (the terminal's reached it: here, by hand), or by SIGTERM
    stand_in = (
        "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(1)); time.sleep(60)"
    )
    if signum == signal.SIGINT:  # the terminal's Ctrl-C reaches torchrun too: here, by hand, a second later
        threading.Timer(1.0, lambda: os.kill(_SignalledWhileStarting.started[0], signal.SIGINT)).start()
    try:
        assert run_launcher([sys.executable, "-c", stand_in]) == 128 + signum
    finally:
        for pid in _SignalledWhileStarting.started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
