"""Elastic recovery: `moe-lab train --max-restarts 1` runs torchrun's elastic agent. One rank is killed with
SIGKILL mid-run (rank 0, the one holding the output-directory lock: the harder case); the agent stops the
group and starts it again, the restarted workers resume from the newest complete checkpoint, the new rank 0
takes over the lock the dead one left (a kernel flock dies with its holder), and the run ends with weights
bitwise equal to an uninterrupted run of the same layout."""

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from moe_core.train import read_jsonl
from moe_core.train.checkpoint import gather_state_dict
from tests.dist_helpers import cli, env, run_cli, train_args

STEPS = 12
LAYOUT = ["--nproc", "2", "--set", "parallel.ep_size=2"]


def worker_pid(out, rank: int, attempt: int) -> int | None:
    """The pid of the training worker of ``rank`` in the agent's ``attempt``-th group for ``out``."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if str(out) not in cmdline or "torch.distributed.run" in cmdline:
                continue
            environ = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if environ.get("RANK") == str(rank) and environ.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
            return proc.pid
    return None


@pytest.mark.slow
def test_sigkilled_rank_restarts_group_and_resumes_bitwise(tmp_path):
    reference, elastic = tmp_path / "uninterrupted", tmp_path / "elastic"
    run_cli(reference, *train_args(STEPS, every=4), *LAYOUT)

    agent = subprocess.Popen(
        cli(elastic, *train_args(STEPS, every=4), *LAYOUT, "--max-restarts", "1"),
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, killed = time.monotonic() + 300, None
        while killed is None and time.monotonic() < deadline and agent.poll() is None:
            if (elastic / "checkpoints" / "step_00000004").is_dir() and (pid := worker_pid(elastic, 0, 0)):
                psutil.Process(pid).kill()  # SIGKILL: no handler, no last checkpoint, the lock left behind
                killed = pid
            time.sleep(0.05)
        log = agent.communicate(timeout=400)[0]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)  # the agent and its workers: nothing outlives the test
    assert killed is not None, "the run ended before a worker could be killed"
    assert agent.returncode == 0, log[-4000:]
    assert "taking over the lock" in log  # the restarted rank 0 took the dead one's lock

    rows = [r for r in read_jsonl(elastic / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, despite the restart
    assert rows[-1]["elastic/restarts"] == 1.0
    ref_rows = [r for r in read_jsonl(reference / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    final = f"checkpoints/step_{STEPS:08d}"
    a, b = gather_state_dict(reference / final), gather_state_dict(elastic / final)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_each_restart_attempt_sees_only_its_own_store_keys(monkeypatch):
    """The agent's store outlives a dead group: a restarted group must not read the old group's keys (gloo
    peer addresses), or a fast new rank dials a dead one's port."""
    from datetime import timedelta

    import torch.distributed as dist

    from moe_core.train.parallel import _attempt_store
    from tests.dist_helpers import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _attempt_store(timedelta(seconds=5))
    first.set("default_pg/0//rank_0", b"dead-rank-0-address")
    assert first.check(["default_pg/0//rank_0"]) and agent_store.num_keys() > 0  # in the agent's store
    # the same process opening a group again in the same attempt (several trainers in one worker): fresh keys
    assert not _attempt_store(timedelta(seconds=5)).check(["default_pg/0//rank_0"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = _attempt_store(timedelta(seconds=5))
    assert not second.check(["default_pg/0//rank_0"])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert _attempt_store(timedelta(seconds=5)) is None  # no agent store: init_process_group's own
