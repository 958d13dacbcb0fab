"""One process at a time on the MLflow store where it matters: creating the SQLite database (MLflow's
schema migration is not safe against a second process doing the same) and the promotion decision (read the
champion, compare, move the alias: two lifecycles interleaving those steps both "win").

An exclusive `fcntl.flock` on a lock file in the store's directory (``mlflow.db.lock`` beside a SQLite
store; under the lab home for a tracking server, which serializes the lifecycles of this machine only). The
kernel drops the lock when its holder dies, so a killed process never leaves the store locked.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from tasks import settings


def lock_path(tracking_uri: str) -> Path:
    """The lock file of the store at ``tracking_uri``."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":
        db = (
            Path(tracking_uri[len("sqlite:///") :])
            if tracking_uri.startswith("sqlite:///")
            else Path(parsed.path)
        )
        return db.with_name(db.name + ".lock")
    if parsed.scheme in ("", "file"):
        return Path(parsed.path or tracking_uri) / ".moe_lab.lock"
    return settings.lab_home() / "mlflow-store.lock"


@contextmanager
def store_lock(tracking_uri: str, purpose: str) -> Iterator[None]:
    """Hold the store's lock for the block; waits (saying who holds it) while another process has it."""
    path = lock_path(tracking_uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            print(
                f"moe-lab: waiting for the MLflow store lock {path} ({purpose}; held by {holder})",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}: {purpose}\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)
