"""The training process runner: a failure or cancellation stops the whole process group, grandchildren too."""

from __future__ import annotations

import os
import sys

import pytest

from tasks.process import TrainingProcessDied, run_group


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
