"""Shared fixtures, and how the suite is spread over pytest-xdist workers (pyproject's ``-n auto``)."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
import torch

# Files whose tests share one expensive session fixture run on the same worker, so it is built once.
SHARED_FIXTURE_GROUPS = {
    "test_train_parallel.py": "ep2_run",
    "test_dashboard_api.py": "ep2_run",
    "test_ray_launch.py": "local_ray",
    "test_data_ray.py": "local_ray",
}


def _share_the_cores() -> None:
    """Under xdist each worker takes its share of the cores, for its own torch and for the processes its tests
    start (``OMP_NUM_THREADS``, unless set): with every worker's torch on every core, 2 workers on 2 cores ran
    each in-process matmul oversubscribed (up to 30x slower for tiny ones, see `one_thread`), and a module
    fixture that trains a model runs before any function fixture could lower it. Set at import, before any
    fixture; a run without xdist (``-n 0``) keeps torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_the_cores()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core plus one, at most five. Most of the suite's time is processes starting
    (importing torch and transformers) and tests waiting on the processes and servers they start, during which
    a core sits idle: on 2 cores, 3 workers ran the suite in 694 s where 2 took 839 s, at the same CPU time
    (2026-11-26). Past five, the multi-process tests (2-4 processes each) only oversubscribe the cores."""
    return max(1, min((os.cpu_count() or 1) + 1, 5))


@pytest.hookimpl(
    tryfirst=True
)  # before xdist's own hook, which turns the marks into the groups it schedules by
def pytest_collection_modifyitems(config, items):
    """Each test file is one unit of work for ``--dist loadgroup`` (its module fixtures are built once), and
    the files in `SHARED_FIXTURE_GROUPS` share a worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group(SHARED_FIXTURE_GROUPS.get(name, name)))


@pytest.fixture()
def one_thread():
    """Tiny matmuls on a shared 2-core machine: one torch thread avoids OpenMP oversubscription, which made
    them up to 30x slower. Test modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def lab_env(tmp_path_factory):
    """One Prefect test server and one MLflow SQLite store for the whole session (the server takes 15-20 s
    to start), with MOE_LAB_HOME in a temporary directory. Yields that directory."""
    home = tmp_path_factory.mktemp("moe_lab_home")
    patch = pytest.MonkeyPatch()
    patch.setenv("MOE_LAB_HOME", str(home))
    patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    patch.setenv("PREFECT_HOME", str(home / "prefect"))
    patch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    patch.delenv("PREFECT_API_URL", raising=False)
    import mlflow
    from prefect.settings import PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with temporary_settings(
        updates={PREFECT_HOME: home / "prefect", PREFECT_LOCAL_STORAGE_PATH: home / "prefect" / "storage"}
    ):
        with prefect_test_harness(server_startup_timeout=120):
            yield home
    patch.undo()


@pytest.fixture(scope="session")
def ep2_run(tmp_path_factory):
    """One two-process expert-parallel training run (gloo, 20 steps of mixtral-tiny, every step logged), shared:
    tests/test_train_parallel.py checks that it follows one process, tests/test_dashboard_api.py that the
    dashboard shows it per rank. Alone in its runs folder."""
    from tests.test_train_parallel import run_cli

    out = tmp_path_factory.mktemp("ep2-runs") / "ep2"
    run_cli(out, "--nproc", "2", "--set", "parallel.ep_size=2")
    return out


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, to fill the disk (needs root to mount; skipped elsewhere)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray cluster of two CPUs for the tests that run on Ray (starting one takes ~20 s here); the
    lab's Ray paths join a cluster this process already has."""
    import ray  # the test extra installs it: a missing ray fails these tests rather than skipping them

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture()
def sqlite_store(tmp_path, monkeypatch):
    """A fresh MLflow SQLite store (its URI) as the tracking URI, with the lab's home under ``tmp_path``."""
    import mlflow  # heavy (~5 s): only the tests that use the store pay for it

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MOE_LAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(previous)
