"""What the dashboard reads: run directories under the runs roots, tailed incrementally, and downsampled.

A training run is a directory holding ``metrics.jsonl`` (the trainer's event file; ``metrics.rank<r>.jsonl``
beside it where ranks write their own) and, from the trainer's `RoutingMonitor`, ``routing_loads.f32``: the
per-layer expert loads as float32 rows, memory-mapped here through one `LoadLogReader` per run (its layout
lives in `moe_core.train.load_log`). An inference run holds ``inference.jsonl``.

Safety: a run is addressed by an opaque id that maps to a directory found by walking the roots; no request
ever builds a path from user input, and a directory (or symlink) resolving outside its root is skipped.
Only numbers are read from event files: string values (there should be none) are dropped.
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson  # a Prefect dependency; parses the event file ~4x faster than json

from moe_core.train.load_log import SIDECAR, SIDECAR_HEADER, LoadLogLayout, LoadLogReader
from moe_core.train.telemetry import RANK_KEYS

EVENTS = "metrics.jsonl"
INFERENCE_EVENTS = "inference.jsonl"
LIVE_SECONDS = 30.0  # a run whose event file changed this recently is shown as live
MAX_DEPTH = 4  # how deep under a root run directories are looked for
PARSE_BLOCK = 1 << 20  # event-file bytes parsed per call (see EventTail._parse_blocks)
RANK_FILE = re.compile(r"^metrics\.rank(\d+)\.jsonl$")
RANK_KEY = re.compile(r"^comm/rank_(\d+)/(.+)$")
RECENT_ROWS = 2000  # event-file rows kept whole for live streams (each client reads from its own cursor)


_NUMBER = (int, float)  # exact classes: bool (a subclass of int) is left out


def _strip_pattern(prefixes: tuple[str, ...]) -> re.Pattern | None:
    """Matches ``, "<prefix>...": <value>`` in an event line: a key the reader skips anyway, cut out of the
    bytes before parsing (most of a big run's bytes are per-layer keys). Values are numbers or short strings
    ("nan"); a quote inside a JSON string is escaped, so ``,"`` never starts inside one."""
    if not prefixes:
        return None
    alternatives = b"|".join(re.escape(p.encode()) for p in prefixes)
    return re.compile(rb', ?"(?:' + alternatives + rb")[^,}\n]*")  # json.dumps writes ", ", orjson ","


def _parse_lines(data: bytes, strip: re.Pattern | None = None) -> list:
    """Every complete JSON line of ``data``; one orjson call for the whole block, line by line only when a
    line is torn (a crash mid-write), which is then skipped. ``strip`` cuts skipped keys out first (the
    caller still filters keys: this is only faster)."""
    if strip is not None:
        try:
            lines = [line for line in strip.sub(b"", data).splitlines() if line.strip()]
            return orjson.loads(b"[" + b",".join(lines) + b"]")
        except orjson.JSONDecodeError:
            pass  # a torn line, or a value the pattern did not expect: parse it all the careful way
    lines = [line for line in data.splitlines() if line.strip()]
    try:
        return orjson.loads(b"[" + b",".join(lines) + b"]")
    except orjson.JSONDecodeError:
        out = []
        for line in lines:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
        return out


def run_id(root_index: int, rel: str) -> str:
    return hashlib.sha1(f"{root_index}:{rel}".encode()).hexdigest()[:12]


@dataclass
class Column:
    """One metric over the rows of an event file: steps and values, grown in place."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class EventTail:
    """Parses only what was appended to a JSONL event file since the last call (whole lines only)."""

    def __init__(self, path: Path, root: Path, skip_prefixes: tuple[str, ...] = ()) -> None:
        self.path, self.root, self.offset, self.skip = path, root, 0, skip_prefixes
        self._strip = _strip_pattern(skip_prefixes)
        self._skipped: set[str] = set()  # keys seen that start with a skip prefix (classified once)
        self._seen: set[str] = set()
        self.rows = 0  # rows parsed so far; also the sequence number of the last one
        self.recent: collections.deque[tuple[int, dict]] = collections.deque(maxlen=RECENT_ROWS)
        self.columns: dict[str, Column] = {}
        self.alerts: dict[str, dict] = {}  # alert key -> first/last step and value
        self.last_time: float | None = None

    def poll(self) -> list[dict]:
        """New complete rows (numbers only), also folded into `columns`."""
        if not is_inside(
            self.path, self.root
        ):  # checked on every read: a symlink swapped in later is refused
            return []
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # the file was replaced: start over
            self.__init__(self.path, self.root, self.skip)
        if size == self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        new = []
        skip = self.skip or ("\0",)
        for raw in self._parse_blocks(data[: end + 1]):
            if not isinstance(raw, dict) or not isinstance(raw.get("step"), int | float):
                continue
            step = float(raw["step"])
            # numbers only (a string, there should be none, is never kept or served); per-layer keys first
            # out, they are most keys of a big run and live in the load log
            keys = raw.keys()
            if not keys <= self._seen:  # a key not met before: classify it once (set operations run in C)
                fresh = keys - self._seen
                self._seen |= fresh
                self._skipped |= {k for k in fresh if k.startswith(skip)}
            row = {k: raw[k] for k in keys - self._skipped if raw[k].__class__ in _NUMBER}
            row["step"] = step
            for key in [k for k in row if k.startswith("alert/")]:
                value = row[key]
                seen = self.alerts.setdefault(key, {"key": key, "first_step": step, "value": value})
                seen["last_step"], seen["value"] = step, value
            self.rows += 1
            self.recent.append((self.rows, row))
            new.append(row)
        for key in {k for row in new for k in row} - {"step"}:
            if key.startswith("alert/"):
                continue
            col = self.columns.get(key)
            if col is None:
                col = self.columns[key] = Column()
            col.steps.extend(row["step"] for row in new if key in row)
            col.values.extend(float(row[key]) for row in new if key in row)
        if new and "time" in new[-1]:
            self.last_time = new[-1]["time"]
        return new

    def _parse_blocks(self, data: bytes):
        """The rows of ``data`` (whole lines), parsed in blocks of about `PARSE_BLOCK` bytes: one C call on
        a 35 MB file holds the GIL for half a second, and the server's other requests (the page itself,
        the load-log heatmaps) would wait for all of it."""
        start = 0
        while start < len(data):
            cut = data.find(b"\n", min(start + PARSE_BLOCK, len(data) - 1)) + 1 or len(data)
            yield from _parse_lines(data[start:cut], self._strip)
            start = cut
            time.sleep(0)  # let the other threads take the GIL between blocks

    def rows_after(self, seq: int) -> list[dict]:
        """The kept rows after sequence number ``seq`` (a stream's cursor; several streams share one tail)."""
        return [row for q, row in self.recent if q > seq]


class RunData:
    """One run directory: its event files tailed, its load log mapped, its config and checkpoints."""

    def __init__(self, rid: str, path: Path, root: Path, name: str) -> None:
        self.id, self.path, self.root, self.name = rid, path, root, name
        self.lock = threading.Lock()  # the event-file tails
        self.load_lock = threading.Lock()  # the load log's step column and buckets: never waits on a parse
        self.log_lock = threading.Lock()  # the load-log reader (a stat and, when the log grew, a new map)
        self.load_log = LoadLogReader(path)  # one per run, whoever reads it: one map, not one per request
        self.kind = "train" if (path / EVENTS).is_file() and is_inside(path / EVENTS, root) else "inference"
        # per-layer keys (moe/...) are read from the binary load log: never parsed into memory twice
        self.tail = EventTail(
            path / (EVENTS if self.kind == "train" else INFERENCE_EVENTS), root, skip_prefixes=("moe/",)
        )
        self.rank_tails: dict[int, EventTail] = {}  # rank -> its own event file, where ranks write one
        self._find_rank_files()
        self._sidecar_rows = 0
        self._steps = np.zeros(0, dtype=np.float64)
        self._buckets: tuple[tuple, np.ndarray, np.ndarray] | None = None  # the last downsampled load log
        self._baseline: tuple[str | None, str | None] = (None, None)  # (checkpoint read, model.baseline)

    def _find_rank_files(self) -> None:
        for p in self.path.glob("metrics.rank*.jsonl"):
            m = RANK_FILE.match(p.name)
            if m and int(m[1]) not in self.rank_tails and is_inside(p, self.root):
                self.rank_tails[int(m[1])] = EventTail(p, self.root, ("moe/",))

    # ------------------------------------------------------------------ reading
    def refresh(self) -> list[dict]:
        with self.lock:
            for t in self.rank_tails.values():
                t.poll()
            return self.tail.poll()

    def rank_columns(self) -> dict[int, dict[str, Column]]:
        """Per rank: the ``comm/rank_<r>/...`` figures of the main event file (every rank's all-to-all time
        and bytes, gathered by rank 0) and each rank's own event file, where ranks write one (step time,
        tokens/s, peak memory: rank 0's from the main file)."""
        with self.lock:
            self._find_rank_files()
        self.refresh()
        out: dict[int, dict[str, Column]] = {}
        for key, col in self.tail.columns.items():
            m = RANK_KEY.match(key)
            if m:
                out.setdefault(int(m[1]), {})[m[2]] = col
        for rank, tail in self.rank_tails.items():
            out.setdefault(rank, {}).update(tail.columns)
        if self.rank_tails:  # rank 0's own figures are in the main file (`moe_core.train.telemetry.rank_row`)
            main = self.tail.columns
            out.setdefault(0, {}).update({key: main[key] for key in RANK_KEYS if key in main})
        return out

    def sidecar(self) -> tuple[LoadLogLayout | None, np.ndarray | None, np.ndarray | None]:
        """The load log: its layout, a read-only map of its whole rows, and their steps (float64)."""
        if not all(is_inside(self.path / name, self.root) for name in (SIDECAR, SIDECAR_HEADER)):
            return None, None, None  # a symlink out of the runs root is never followed
        with self.log_lock:
            layout, rows = self.load_log.rows()
        if layout is None:
            return None, None, None
        n = rows.shape[0]
        with self.load_lock:
            if n != self._sidecar_rows:  # read only the new rows' step column
                if n > self._sidecar_rows:
                    new = np.asarray(layout.steps(rows[self._sidecar_rows :]), np.float64)
                    self._steps = np.concatenate([self._steps, new])
                else:
                    self._steps = np.asarray(layout.steps(rows), np.float64)
                self._sidecar_rows = n
            steps = self._steps[:n]
        return layout, rows, steps

    def close(self) -> None:
        """Let go of the load log's map (the run left the roots, or the server stops)."""
        with self.log_lock:
            self.load_log.close()

    def load_buckets(self, rows: np.ndarray, lo: int, hi: int, points: int) -> tuple[np.ndarray, np.ndarray]:
        """Bucket means of load-log rows ``[lo, hi)`` over every column (all layers in one pass), kept for the
        next request with the same rows and points: a page asks for each of its layers in turn. One entry
        only, so memory stays bounded (points x row width floats)."""
        key = (rows.shape[0], lo, hi, points)
        with self.load_lock:
            if self._buckets is not None and self._buckets[0] == key:
                return self._buckets[1], self._buckets[2]
            edges, means = downsample_rows(rows[lo:hi], points)
            means = means.astype(np.float32)  # what was logged
            self._buckets = (key, edges, means)
            return edges, means

    def mlflow_run_id(self) -> str | None:
        """The MLflow run this run directory logged to (``mlflow_run.json``, written by the tracking sink)."""
        file = self.path / "mlflow_run.json"
        if not file.is_file() or not is_inside(file, self.root):
            return None
        try:
            found = orjson.loads(file.read_bytes()).get("run_id")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    def is_live(self) -> bool:
        """Its event file changed in the last `LIVE_SECONDS`, and it has not finished since: a training run
        writes ``final/`` and a fine-tune ``summary.json`` after its last event (a run resumed later writes
        events after them again)."""
        try:
            mtime = self.tail.path.stat().st_mtime
        except FileNotFoundError:
            return False
        if time.time() - mtime >= LIVE_SECONDS:
            return False
        for marker in (self.path / "final", self.path / "summary.json"):
            try:
                if marker.stat().st_mtime >= mtime:
                    return False
            except FileNotFoundError:
                continue
        return True

    def config(self) -> dict | None:
        """The training config (from the newest checkpoint that has one); numbers and names, no text."""
        ckpts = self.checkpoints()
        for ck in reversed(ckpts):
            file = self.path / "checkpoints" / ck["name"] / "train_config.json"
            if file.is_file() and is_inside(file, self.root):
                return orjson.loads(file.read_bytes())
        return None

    def checkpoints(self) -> list[dict]:
        root = self.path / "checkpoints"
        out = []
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if d.is_dir() and d.name.startswith("step_") and not d.name.startswith("."):
                    try:
                        step = int(d.name.split("_")[1])
                    except (IndexError, ValueError):
                        continue
                    out.append({"name": d.name, "step": step, "time": d.stat().st_mtime})
        return sorted(out, key=lambda c: c["step"])

    def summary(self) -> dict:
        self.refresh()
        layout, rows, _ = self.sidecar()
        last_step = self.tail.columns.get("tokens", Column()).steps[-1:] or [None]
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind,
            "live": self.is_live(),
            "last_step": last_step[0],
            "rows": self.tail.rows,
            "metrics": sorted(self.tail.columns),
            "layers": list(layout.layers) if layout else [],
            "experts": layout.experts if layout else 0,
            "has_bias": bool(layout and layout.has_bias),
            "routing_rows": 0 if rows is None else int(rows.shape[0]),
            "alerts": sorted(self.tail.alerts.values(), key=lambda a: (a["first_step"], a["key"])),
            "ranks": len(
                {0, *self.rank_tails, *(int(m[1]) for k in self.tail.columns if (m := RANK_KEY.match(k)))}
            ),
        }

    def baseline(self) -> str | None:
        """``active`` or ``total`` when this run trained a dense baseline for comparison (its saved config's
        ``model.baseline``, as the lifecycle trains one beside its MoE), else None. Read once per checkpoint."""
        ckpts = self.checkpoints()
        newest = ckpts[-1]["name"] if ckpts else None
        if newest != self._baseline[0]:
            config = self.config() or {}
            model = config.get("model") if isinstance(config.get("model"), dict) else {}
            found = model.get("baseline")
            self._baseline = (newest, found if isinstance(found, str) else None)
        return self._baseline[1]

    def listing(self) -> dict:
        try:
            mtime = self.tail.path.stat().st_mtime
        except FileNotFoundError:
            mtime = 0.0
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind,
            "live": self.is_live(),
            "mtime": mtime,
            "root": str(self.root),
            "baseline": self.baseline() if self.kind == "train" else None,
        }


def is_inside(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves to a place under ``root`` (what a served file must be)."""
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except (ValueError, OSError):
        return False


class RunRegistry:
    """The runs found under the roots, by id; rescanned when asked for a listing (cheap: a directory walk)."""

    def __init__(self, roots: list[str | Path]) -> None:
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        self.runs: dict[str, RunData] = {}
        self.lock = threading.Lock()

    def scan(self) -> list[RunData]:
        found: dict[str, RunData] = {}
        for i, root in enumerate(self.roots):
            if not root.is_dir():
                continue
            for path in self._walk(root, root, 0):
                rel = path.relative_to(root).as_posix() or "."
                rid = run_id(i, rel)
                name = rel if rel != "." else root.name
                with self.lock:
                    run = self.runs.get(rid)
                    if run is None:
                        run = RunData(rid, path, root, name)
                        # index its event file now, in the background: a page opened on it next does not
                        # wait for a long run's first parse (requests wait on the run's lock meanwhile)
                        threading.Thread(target=run.refresh, name=f"index-{rid}", daemon=True).start()
                    found[rid] = run
        with self.lock:
            gone = [run for rid, run in self.runs.items() if rid not in found]
            self.runs = found
        for run in gone:
            run.close()
        return sorted(found.values(), key=lambda r: r.listing()["mtime"], reverse=True)

    def _walk(self, root: Path, directory: Path, depth: int):
        if not is_inside(directory, root):  # a symlink out of the root
            return
        events = [directory / EVENTS, directory / INFERENCE_EVENTS]
        if any(f.is_file() and is_inside(f, root) for f in events):  # a symlinked event file must stay inside
            yield directory
        if depth >= MAX_DEPTH:
            return
        try:
            children = sorted(directory.iterdir())
        except OSError:
            return
        for child in children:
            if child.name.startswith(".") or child.name in ("checkpoints", "final", "data"):
                continue
            if child.is_dir() and is_inside(child, root):
                yield from self._walk(root, child, depth + 1)

    def get(self, rid: str) -> RunData | None:
        with self.lock:
            run = self.runs.get(rid)
        if run is None:
            self.scan()
            with self.lock:
                run = self.runs.get(rid)
        return run


# ---------------------------------------------------------------------------------------------- downsampling
def bucket_edges(n: int, points: int) -> np.ndarray:
    """Start index of each of at most ``points`` equal buckets over ``n`` rows."""
    if n <= points:
        return np.arange(n)
    return np.unique(np.linspace(0, n, points, endpoint=False).astype(np.int64))


def downsample_series(steps: np.ndarray, values: np.ndarray, points: int) -> dict:
    """Bucket means with min and max per bucket (so a spike is never averaged away), NaN-aware."""
    n = len(steps)
    if n <= points:
        return {"x": steps.tolist(), "y": json_floats(values), "min": None, "max": None}
    edges = bucket_edges(n, points)
    counts = np.diff(np.append(edges, n))
    finite = np.isfinite(values)
    safe = np.where(finite, values, 0.0)
    sums = np.add.reduceat(safe, edges)
    nums = np.add.reduceat(finite.astype(np.float64), edges)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / nums
    lo = np.minimum.reduceat(np.where(finite, values, np.inf), edges)
    hi = np.maximum.reduceat(np.where(finite, values, -np.inf), edges)
    x = np.add.reduceat(steps, edges) / counts
    return {"x": x.tolist(), "y": json_floats(mean), "min": json_floats(lo), "max": json_floats(hi)}


def downsample_rows(rows_NC: np.ndarray, points: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket means of a ``[rows, columns]`` block in equal buckets of ``ceil(rows / points)`` rows (the last
    one shorter); returns (edges, means[buckets, columns]). The buckets are summed as a reshaped view
    (``[buckets, k, columns]``), straight from a memory map: a pass in memory order, 20x faster than
    ``np.add.reduceat`` along rows for a 10k x 3k block."""
    n = rows_NC.shape[0]
    if n <= points:
        return np.arange(n), np.asarray(rows_NC, dtype=np.float64)
    k = -(-n // points)
    full = n // k
    edges = np.arange(0, n, k)
    # float64 sums; a NaN (a layer that saw no tokens) makes its bucket null
    sums = rows_NC[: full * k].reshape(full, k, -1).sum(1, dtype=np.float64)
    if full * k < n:
        sums = np.vstack([sums, rows_NC[full * k :].sum(0, dtype=np.float64)[None]])
    counts = np.diff(np.append(edges, n))[:, None]
    return edges, sums / counts


def json_floats(values) -> list:
    """JSON-safe floats: NaN and infinities become null."""
    return [v if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64).tolist()]
