"""Run a training command as its own process group, so cancelling the flow (or a failing task) stops every
process it started, torchrun workers included.

The group is asked to stop with SIGTERM first (the trainer checkpoints on SIGTERM), then killed after
``grace_s``. ``MOE_LAB_CHAOS_KILL_AFTER_STEP=N`` SIGKILLs the group once a checkpoint of step >= N exists,
on a task's first attempt only: the recovery test (and anyone checking their own setup) uses it.

`sigterm_exits` makes SIGTERM end this process the way Ctrl-C does (an exception, so ``finally`` blocks run and
stop what the process started); `run_until_stopped` runs a server (``moe-lab ui``) until it ends or this
process is asked to stop, and then stops its whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_core.train.checkpoint import latest_checkpoint, read_trainer_state

CHAOS_ENV = "MOE_LAB_CHAOS_KILL_AFTER_STEP"


class TrainingProcessDied(RuntimeError):
    """The training process ended with a non-zero status (killed, crashed); a retry resumes it."""


def checkpoint_step(out_dir: Path) -> int:
    latest = latest_checkpoint(out_dir / "checkpoints")
    return -1 if latest is None else int(read_trainer_state(latest)["step"])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, read from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(entry.name))
    return members


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group, wait up to ``grace_s`` for every member (grandchildren too, not only the
    leader), then SIGKILL whatever is left and wait for it to be gone."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_members(proc.pid):
                return
            time.sleep(0.05)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM for the block (starting a child): a stop signal that lands inside
    `subprocess.Popen`, after the fork and before ``Popen`` returns, would raise where nothing holds the child
    yet and leave its group running, with this process's pipes open. A signal that came meanwhile is sent again
    as the block ends, so its own handler runs at once, in the caller's ``try`` that stops the child. Elsewhere
    than the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in stops}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            # to this (the main) thread: sent to the process, another thread may take it, and the handler
            # would wait for the main thread's blocking call (the caller's wait) to return on its own
            signal.raise_signal(signum)


def run_group(
    cmd: list[str],
    out_dir: Path,
    on_poll: Callable[[], None] = lambda: None,
    first_attempt: bool = True,
    poll_s: float = 1.0,
    env: dict | None = None,
) -> None:
    """Run ``cmd`` in a new session; call ``on_poll`` every ``poll_s`` (e.g. to forward telemetry). Raises
    `TrainingProcessDied` on a non-zero exit; stops the whole group if anything interrupts the wait."""
    chaos = int(os.environ.get(CHAOS_ENV, "0") or 0) if first_attempt else 0
    poll_s = min(poll_s, 0.05) if chaos else poll_s  # catch the checkpoint before the run ends
    proc = None
    try:
        with stop_signals_held():
            proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        while proc.poll() is None:
            time.sleep(poll_s)
            on_poll()
            if chaos and checkpoint_step(out_dir) >= chaos:
                os.killpg(proc.pid, signal.SIGKILL)  # a crash, not a request: no last checkpoint
                proc.wait()
        on_poll()
    finally:
        if proc is not None and proc.poll() is None:
            stop_group(proc)
    if proc.returncode != 0:
        raise TrainingProcessDied(
            f"training process {' '.join(cmd[:6])} ... exited with {proc.returncode}; "
            f"the last checkpoint is step {checkpoint_step(out_dir)} in {out_dir}"
        )


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While active (in the main thread), SIGTERM raises ``SystemExit(143)``: ``finally`` blocks run and stop
    the servers and process groups this process started. Python's default ends the process on the spot and
    leaves them running. Elsewhere than the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_until_stopped(cmd: list[str], env: dict | None = None, grace_s: float = 10.0) -> int:
    """Run ``cmd`` as its own process group and return its exit status; when this process is asked to stop
    first (Ctrl-C, SIGTERM), stop the whole group (``cmd`` and every process it started: a server's workers)
    and return 128 + the signal's number (130, 143)."""
    proc = None
    try:
        with sigterm_exits():
            with stop_signals_held():
                proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            return proc.wait()
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except SystemExit as stop:
        return int(stop.code)
    finally:
        if proc is not None and (proc.poll() is None or _group_members(proc.pid)):
            stop_group(proc, grace_s)


def stop_as_the_signal_asked(stopped_by: str | None) -> None:
    """A job run in this process (training, fine-tuning) that a signal stopped has saved what it could and
    returned; stop this process too, as the signal asked: KeyboardInterrupt for Ctrl-C, SystemExit(143) for
    SIGTERM. In a flow that means no Prefect retry (which would start the job again at once) and no later
    stage on a half-trained model; the MLflow runs close KILLED. Nothing happens when ``stopped_by`` is None."""
    if stopped_by == "SIGINT":
        raise KeyboardInterrupt
    if stopped_by:
        raise SystemExit(128 + signal.Signals[stopped_by].value)
