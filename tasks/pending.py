"""What MLflow has not received yet: a flow's pending manifest, kept while the tracking server is unreachable.

When MLflow cannot be reached (at the start of a flow, or from the moment it dies), `tasks.tracking` stops
calling it for the rest of the process and appends each record it would have sent (start a run, params,
metrics, an artifact's local path, a model directory, tags, the run's final status, a registration) as one
JSON line to ``<flow out dir>/mlflow_pending.jsonl``. Runs started meanwhile get local ids (``pending-...``).
``moe-lab sync <flow out dir>`` replays the lines in order (`tasks.sync`), mapping local ids to the real
ones, and records its progress in ``mlflow_pending.state.json``, so a second sync sends nothing twice.

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
from pathlib import Path
from typing import Any

from tasks import settings

JOURNAL = "mlflow_pending.jsonl"
STATE = "mlflow_pending.state.json"
LOCAL_PREFIX = "pending-"

_lock = threading.Lock()
_journal_dir: Path | None = None  # the current flow's output directory (set by `tasks.stages.flow_record`)
_offline_reason: str | None = None  # set once MLflow was found unreachable in this process
_written: set[Path] = set()  # journals this process appended to
_strict = False  # `moe-lab sync`: every record goes to MLflow or fails, nothing is deferred again


def new_local_id() -> str:
    return f"{LOCAL_PREFIX}{uuid.uuid4().hex}"


def is_local(run_id: str | None) -> bool:
    return bool(run_id) and str(run_id).startswith(LOCAL_PREFIX)


def offline_reason() -> str | None:
    return _offline_reason


def go_offline(reason: str) -> None:
    global _offline_reason
    if _offline_reason is None:
        _offline_reason = reason


def reset(journal_dir: str | Path | None, reason: str | None = None) -> None:
    """A new flow: its journal directory, and whether MLflow is reachable (None: yes) as probed now."""
    global _journal_dir, _offline_reason
    _journal_dir = Path(journal_dir) if journal_dir is not None else None
    _offline_reason = reason


@contextmanager
def no_deferral() -> Iterator[None]:
    """While replaying a manifest: an MLflow failure raises (the sync stops and resumes next time)."""
    global _strict, _offline_reason
    previous, _strict, _offline_reason = _strict, True, None
    try:
        yield
    finally:
        _strict = previous


def deferral_allowed() -> bool:
    return not _strict


def journal_path() -> Path:
    return (_journal_dir or settings.lab_home()) / JOURNAL


def pending_journal() -> Path | None:
    """The journal this process wrote to for the current flow, or None when nothing is pending."""
    path = journal_path()
    return path if path in _written else None


def record(op: str, run_id: str | None, **payload: Any) -> None:
    """Append one operation (flushed and fsynced: a crash loses at most the line being written)."""
    path = journal_path()
    line = json.dumps({"op": op, "run": run_id, **payload}, default=str) + "\n"
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        _written.add(path)


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
