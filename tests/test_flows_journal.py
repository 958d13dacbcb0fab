"""The offline journal (`tasks.pending.Journal`) is one object per flow: two flows in one process keep their
outages and records apart, the training sink's thread reports to its own flow's journal, and `moe-lab sync`'s
strict journal never defers. No MLflow server and no Prefect server: MLflow's client is a stand-in here."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tasks import pending, stages, tracking
from tasks.pending import JOURNAL, Journal, read_journal


class FakeClient:
    """The few `MlflowClient` calls these tests make; runs whose id starts with ``dead-`` fail (an outage)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def set_tag(self, run_id, key, value):
        if run_id.startswith("dead-"):
            raise ConnectionError("connection refused")
        with self.lock:
            self.calls.append(("set_tag", run_id, key, value))

    def set_terminated(self, run_id, status):
        if run_id.startswith("dead-"):
            raise ConnectionError("connection refused")
        with self.lock:
            self.calls.append(("set_terminated", run_id, status))


@pytest.fixture()
def fake_mlflow(monkeypatch, tmp_path):
    client = FakeClient()
    monkeypatch.setenv("MOE_LAB_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tracking, "client", lambda: client)
    monkeypatch.setattr(tracking, "probe", lambda uri=None, timeout=3.0: "MLflow at test is unreachable")
    monkeypatch.setattr(tracking, "tracking_uri", lambda: "http://mlflow.test")
    return client


def ops(journal: Journal) -> list[tuple[str, str | None]]:
    return [(e["op"], e["run"]) for e in read_journal(journal.path)] if journal.path.is_file() else []


def run_in_threads(*targets) -> None:
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_two_offline_flows_in_one_process_keep_separate_journals(fake_mlflow, tmp_path):
    """Both flows are open at the same time (a barrier interleaves them); each flow's records land in its own
    directory with its own reason. A process-wide journal sent the first flow's later records to the second's."""
    both_open = threading.Barrier(2)
    journals = {name: Journal(tmp_path / name, offline_reason=f"{name} is offline") for name in ("a", "b")}
    run_ids: dict[str, str] = {}

    def flow(name: str):
        def body() -> None:
            with stages.flow_record(name, {"flow": name}, journals[name]) as run_id:
                run_ids[name] = run_id
                both_open.wait(10)
                tracking.set_tags(run_id, {"stage": name})
                assert pending.current() is journals[name]
                both_open.wait(10)

        return body

    run_in_threads(flow("a"), flow("b"))
    for name, journal in journals.items():
        assert run_ids[name].startswith(pending.LOCAL_PREFIX)
        entries = read_journal(journal.path)
        assert [e["op"] for e in entries] == ["start_run", "log_params", "set_tags", "end_run"]
        assert entries[0]["name"] == name and entries[0]["local"] == run_ids[name]
        assert {e["run"] for e in entries[1:]} == {run_ids[name]}
        assert journal.summary() == {
            "mlflow_pending": str(tmp_path / name / JOURNAL),
            "mlflow_offline": f"{name} is offline",
            "sync_command": f"moe-lab sync {tmp_path / name}",
        }
    assert fake_mlflow.calls == []
    assert pending.current().summary() == {}  # outside any flow: a fresh journal, nothing remembered


def test_an_outage_found_by_one_flow_leaves_the_other_flow_talking_to_mlflow(fake_mlflow, tmp_path):
    """Flow A's MLflow fails mid-flow (A goes offline, its records wait in A's journal); flow B, open at the
    same time, keeps sending to MLflow and writes no journal."""
    a, b = Journal(tmp_path / "a"), Journal(tmp_path / "b")
    a_is_offline = threading.Event()

    def flow_a() -> None:
        with pending.use(a):
            tracking.set_tags("dead-a", {"k": "v"})  # fails, MLflow is probed: unreachable
            a_is_offline.set()
            tracking.end_run("dead-a")

    def flow_b() -> None:
        with pending.use(b):
            assert a_is_offline.wait(10)
            tracking.set_tags("live-b", {"k": "v"})
            tracking.end_run("live-b")

    run_in_threads(flow_a, flow_b)
    assert a.offline_reason == "MLflow at test is unreachable"
    assert ops(a) == [("set_tags", "dead-a"), ("end_run", "dead-a")]
    assert b.offline_reason is None and b.summary() == {} and not b.path.exists()
    assert fake_mlflow.calls == [("set_tag", "live-b", "k", "v"), ("set_terminated", "live-b", "FINISHED")]


def test_sync_s_strict_journal_raises_instead_of_deferring(fake_mlflow, tmp_path):
    strict = Journal(tmp_path, strict=True)
    with pending.use(strict), pytest.raises(ConnectionError):
        tracking.set_tags("dead-run", {"k": "v"})
    assert strict.offline_reason is None and not strict.path.exists()


def test_the_training_sink_takes_its_flow_s_outage_to_that_flow_s_journal(fake_mlflow, tmp_path, monkeypatch):
    """`MlflowSink` forwards from a thread of its own, which does not see the flow's context: it reports the
    outage to the journal current where it was made."""

    def unreachable(*args, **kwargs):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(tracking, "send_metrics", unreachable)
    flow_journal, other = Journal(tmp_path / "flow"), Journal(tmp_path / "other")
    with pending.use(flow_journal):
        sink = tracking.MlflowSink("live-run", tmp_path / "run", close_timeout=10)
    with pending.use(other):
        sink.log(3, {"loss": 1.0})
        sink.close()
    assert sink.offline_from_step == 3
    assert flow_journal.offline_reason == "MLflow at test is unreachable" and other.offline_reason is None

    with pending.use(flow_journal):  # MLflow known down: a new sink starts offline, sends nothing
        later = tracking.MlflowSink("live-run", tmp_path / "run2", mlflow_client=SimpleNamespace())
    later.close()
    assert later.offline_from_step == 0


def test_concurrent_records_are_whole_lines(tmp_path):
    journal = Journal(tmp_path)
    writers = [
        lambda i=i: [journal.record("log_metrics", f"run-{i}", metrics={"x": j}) for j in range(50)]
        for i in range(4)
    ]
    run_in_threads(*writers)
    entries = read_journal(journal.path)
    assert len(entries) == 200 and journal.pending() == journal.path
    for i in range(4):
        assert [e["metrics"]["x"] for e in entries if e["run"] == f"run-{i}"] == list(range(50))
