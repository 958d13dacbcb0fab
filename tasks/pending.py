"""What MLflow has not received yet: a flow's offline journal, kept while the tracking server is unreachable.

One `Journal` per flow run holds everything about it: its file, why MLflow is offline (None while it answers),
whether a failure may be deferred at all, and whether anything was written. The flow opens it
(`tasks.stages.open_journal` probes MLflow) and `tasks.stages.flow_record` makes it the journal of the code
that runs inside the flow (`use`, a context variable: two flows in one process, in two threads, each see their
own; Prefect's task runners copy the context into their threads). Code that runs outside any flow gets a fresh
journal under the lab home for each call (`current`): nothing process-wide is remembered between calls.

When MLflow cannot be reached (at the start of a flow, or from the moment it dies), `tasks.tracking` stops
calling it for the rest of the flow and appends each record it would have sent (start a run, params,
metrics, an artifact's local path, a model directory, tags, the run's final status, a registration) as one
JSON line to ``<flow out dir>/mlflow_pending.jsonl``. Runs started meanwhile get local ids (``pending-...``).
``moe-lab sync <flow out dir>`` replays the lines in order (`tasks.sync`, under a strict journal: every record
goes to MLflow or fails, nothing is deferred again), mapping local ids to the real ones, and records its
progress in ``mlflow_pending.state.json``, so a second sync sends nothing twice.

Only references are kept (paths, configs, numbers, ids), never training text or weights. Training telemetry
is not duplicated here: it stays in each run directory's ``metrics.jsonl`` (see `tracking.sync_events`).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from tasks import settings

JOURNAL = "mlflow_pending.jsonl"
STATE = "mlflow_pending.state.json"
LOCAL_PREFIX = "pending-"


def new_local_id() -> str:
    return f"{LOCAL_PREFIX}{uuid.uuid4().hex}"


def is_local(run_id: str | None) -> bool:
    return bool(run_id) and str(run_id).startswith(LOCAL_PREFIX)


class Journal:
    """One flow's record of what MLflow has not received yet.

    ``directory``: where ``mlflow_pending.jsonl`` goes (the flow's output directory; default the lab home).
    ``offline_reason``: why MLflow cannot be reached, None while it answers (`go_offline` sets it once).
    ``strict``: `moe-lab sync` replaying a journal: an MLflow failure raises, nothing is deferred again.
    Safe to share between the threads of one flow (the training sink's thread goes offline through it)."""

    def __init__(
        self, directory: str | Path | None = None, offline_reason: str | None = None, strict: bool = False
    ) -> None:
        self.directory = Path(directory) if directory is not None else settings.lab_home()
        self.offline_reason = offline_reason
        self.strict = strict
        self.written = False  # whether this flow appended anything to its journal
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.directory / JOURNAL

    @property
    def deferral_allowed(self) -> bool:
        return not self.strict

    def offline(self, run_id: str | None = None) -> bool:
        """Whether records (of ``run_id``, when given) go to the journal instead of MLflow: MLflow is known to
        be unreachable, or the run itself only has a local id yet."""
        return self.offline_reason is not None or is_local(run_id)

    def go_offline(self, reason: str) -> None:
        """MLflow was found unreachable: the first reason stays."""
        with self._lock:
            if self.offline_reason is None:
                self.offline_reason = reason

    def record(self, op: str, run_id: str | None, **payload: Any) -> None:
        """Append one operation (flushed and fsynced: a crash loses at most the line being written)."""
        line = json.dumps({"op": op, "run": run_id, **payload}, default=str) + "\n"
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.written = True

    def pending(self) -> Path | None:
        """The journal file when this flow wrote to it, else None (MLflow has every record)."""
        return self.path if self.written else None

    def summary(self) -> dict[str, str]:
        """For a flow's result: where its records wait for ``moe-lab sync`` (empty when MLflow has them all)."""
        if not self.written:
            return {}
        return {
            "mlflow_pending": str(self.path),
            "mlflow_offline": self.offline_reason or "MLflow failed mid-run",
            "sync_command": f"moe-lab sync {self.directory}",
        }


_current: ContextVar[Journal | None] = ContextVar("moe_lab_mlflow_journal", default=None)


def current() -> Journal:
    """The journal of the flow this code runs in (`use`); outside any flow, a fresh one under the lab home."""
    return _current.get() or Journal()


@contextmanager
def use(journal: Journal) -> Iterator[Journal]:
    """Make ``journal`` the current one for the block (in this thread and the task threads it starts)."""
    token = _current.set(journal)
    try:
        yield journal
    finally:
        _current.reset(token)


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a journal (a torn last line, from a crash mid-write, is left for later)."""
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        if line.strip():
            entries.append(json.loads(line))
    return entries


def read_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE
    state = json.loads(path.read_text()) if path.is_file() else {}
    return {"done": 0, "runs": {}, "models": {}, **state}


def write_state(directory: Path, state: dict[str, Any]) -> None:
    """Atomically (temporary file, then rename): a killed sync leaves the previous state, never half of one."""
    path = directory / STATE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)
