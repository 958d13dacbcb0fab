"""`moe-lab sync DIR`: send MLflow what a flow or a training run kept while the server was unreachable.

1. The flow's pending manifest (``DIR/mlflow_pending.jsonl``, see `tasks.pending`) is replayed in order:
   runs are created for local ids, params, metrics, artifacts and models logged, runs ended with the status
   they ended with, and a pending registration registered and put through the promotion gate.
   Progress is saved after every operation, so a sync that fails half-way (MLflow down again) resumes
   where it stopped, and a second sync sends nothing twice.
2. Training telemetry: every ``mlflow_run.json`` under DIR names an event file (``metrics.jsonl``) whose
   events from the step its sink went offline on are uploaded (`tracking.sync_events`, also idempotent).
A bare training directory (no manifest, no ``mlflow_run.json``) gets a new run with all of its events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_core.errors import MoELabError
from tasks import pending, registry, tracking


class SyncError(MoELabError):
    """Nothing to sync there, or MLflow still cannot be reached."""


def sync(directory: str | Path, run_id: str | None = None, everything: bool = False) -> dict[str, Any]:
    """Replay ``directory``'s pending manifest and upload its event files; returns what was sent. Under a
    strict journal: an MLflow failure stops the sync (the next one resumes), nothing is deferred again."""
    with pending.use(pending.Journal(directory, strict=True)):
        return _sync(Path(directory), run_id, everything)


def _sync(directory: Path, run_id: str | None, everything: bool) -> dict[str, Any]:
    if not directory.is_dir():
        raise SyncError(f"{directory}: not a directory; pass a flow's or a training run's output directory")
    if (reason := tracking.probe()) is not None:
        raise SyncError(f"{reason}: nothing uploaded; run `moe-lab sync {directory}` again once it answers")
    journal = directory / pending.JOURNAL
    state = pending.read_state(directory)
    replayed, notes = 0, []
    if journal.is_file():
        entries = pending.read_journal(journal)
        for i in range(state["done"], len(entries)):
            note = _replay(entries[i], state)
            if note:
                notes.append(note)
            state["done"] = i + 1
            pending.write_state(directory, state)  # after every operation: a failed sync resumes here
            replayed += 1
    events: dict[str, int] = {}
    run_files = sorted(directory.rglob(tracking.RUN_FILE))
    for run_file in run_files:
        run_dir = run_file.parent
        recorded = json.loads(run_file.read_text()).get("run_id")
        target = state["runs"].get(recorded) or (run_id if run_dir == directory else None)
        if pending.is_local(recorded) and target is None:
            notes.append(f"{run_dir}: its MLflow run is still pending (no manifest entry created it)")
            continue
        if (run_dir / "metrics.jsonl").is_file():
            events[str(run_dir)] = tracking.sync_events(run_dir, target, everything)[1]
    if not journal.is_file() and not run_files:
        if not (directory / "metrics.jsonl").is_file():
            raise SyncError(
                f"{directory}: no {pending.JOURNAL}, {tracking.RUN_FILE} or metrics.jsonl here; "
                "pass a flow's or a training run's output directory"
            )
        run_id, events[str(directory)] = tracking.sync_events(directory, run_id, everything)
        state["runs"][str(directory)] = run_id
    return {
        "operations_replayed": replayed,
        "operations_done": state["done"],
        "runs": state["runs"],
        "events_uploaded": events,
        "notes": notes,
    }


def _replay(entry: dict[str, Any], state: dict[str, Any]) -> str | None:
    """Registry operations here (they go through the promotion gate), the rest in `tracking.replay`."""
    if entry["op"] not in ("register", "promote"):
        return tracking.replay(entry, state)
    parent = state["runs"].get(entry.get("run"), entry.get("run"))
    if entry["op"] == "register":
        models = state["models"].get(state["runs"].get(entry["model_run"], entry["model_run"])) or {}
        model_uri = entry["model_uri"] or models.get("transformers") or models.get("files")
        if model_uri is None:
            return f"register {entry['name']}: the model was never logged; not registered"
        version = registry.record_registration(
            entry["name"], tracking.register(model_uri, entry["name"], entry["tags"]), parent
        )
    else:
        version = entry["version"]
    if entry.get("gate"):
        decision = registry.gate(entry["name"], version, **entry["gate"])
        registry.record_decision(decision, parent)
        state.setdefault("decisions", []).append(decision)
    return None
