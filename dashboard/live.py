"""Live streams under a crowd: one reader per run, fanned out to every stream watching it.

A team watching one run opens many streams on it (each browser's Run and Routing pages). Each run being
watched gets one `RunFeed`: a task that, every ``poll_seconds``, reads what the trainer appended (event rows
and load-log rows) in a worker thread, never on the event loop, encodes the update once and hands it to
every subscriber's queue. The feed ends, and holds no file, when its last subscriber leaves; the load-log
rows it reads come through plain reads (`LoadLogReader.read`), so no map outlives a poll.

A new subscriber gets a backlog first (the run's kept event rows and at most `MAX_BACKLOG` load-log rows
after its ``since``), then every update published after it joined: every row once, in order.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import numpy as np
import orjson

from dashboard.runs import RECENT_ROWS, RunData, json_floats
from moe_core.train.load_log import LAYER_STATS, LoadLogLayout

MAX_BACKLOG = 1000  # load-log rows a new stream gets at once; older ones come from /routing
MAX_QUEUED = 300  # updates waiting for one slow client (a minute at 0.2 s) before it is let go to reconnect
KEEPALIVE_SECONDS = 5.0  # a quiet feed sends its streams a comment this often (a proxy keeps them open)
KEEPALIVE = b": keep-alive\n\n"


def load_records(layout: LoadLogLayout, rows_NC: np.ndarray) -> list[dict]:
    """Load-log rows as the stream sends them: per row its step, and per MoE layer the shares, the layer
    figures and (aux-free routers) the biases; NaN becomes null."""
    if rows_NC.shape[0] == 0:
        return []
    cols = layout.decode(np.asarray(rows_NC, dtype=np.float64))
    out = []
    for n, step in enumerate(cols["step"].tolist()):
        record = {"step": step, "frac": [json_floats(frac_E) for frac_E in cols["frac"][n]]}
        for name in LAYER_STATS:
            record[name] = json_floats(cols[name][n])
        if layout.has_bias:
            record["bias"] = [json_floats(bias_E) for bias_E in cols["bias"][n]]
        out.append(record)
    return out


def encode(rows: list[dict], routing: list[dict], alerts: list[dict]) -> bytes:
    """One server-sent event, as bytes: encoded once, written as is to every stream that gets it."""
    return (
        b"event: update\ndata: "
        + orjson.dumps({"rows": rows, "routing": routing, "alerts": alerts})
        + b"\n\n"
    )


@dataclass
class Update:
    """What one poll found: event rows (with their sequence numbers), load-log records, the alerts so far."""

    rows: list[tuple[int, dict]]
    routing: list[tuple[int, dict]]  # (row index in the load log, record)
    alerts: list[dict]
    message: bytes | None = None  # encoded once for every subscriber that keeps all of it


@dataclass(eq=False)
class Subscriber:
    since: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    joined: bool = False  # set with its backlog: updates before that are in the backlog already


class RunFeed:
    """One run's live reader; see the module docstring."""

    def __init__(self, run: RunData, poll_seconds: float, on_idle) -> None:
        self.run, self.poll_seconds, self._on_idle = run, poll_seconds, on_idle
        self.subscribers: set[Subscriber] = set()
        self.rows: collections.deque[tuple[int, dict]] = collections.deque(maxlen=RECENT_ROWS)
        self.loads: collections.deque[tuple[int, dict]] = collections.deque(maxlen=MAX_BACKLOG)
        self.alerts: list[dict] = []
        self._seq = 0  # the last event row read (the run's tail numbers its rows)
        self._load_rows: int | None = None  # load-log rows read so far (None: not yet)
        self.ready = asyncio.Event()  # the first read is in
        self.reads = 0  # polls done (tests count them: one per interval, whatever the subscribers)
        self._backlog: tuple[tuple, bytes | None] | None = (
            None  # the last backlog encoded, for the next joiner
        )
        self._quiet_since = 0.0  # loop time of the last message sent
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"feed-{run.id}")

    # ------------------------------------------------------------------ reading (a worker thread)
    def _read(self) -> Update:
        run = self.run
        run.refresh()
        with run.lock:  # a request's refresh may be appending to the tail meanwhile
            seq = self._seq
            rows = [(q, row) for q, row in run.tail.recent if q > seq]
            alerts = sorted(run.tail.alerts.values(), key=lambda a: a["first_step"])
            alerts = [dict(a) for a in alerts]  # a copy: the tail updates its own in place
        layout, block, start = None, None, 0
        if run.sidecar()[0] is not None:  # the symlink check; the rows themselves come by a plain read
            with run.log_lock:
                n = run.load_log.row_count()
                start = max(0, n - MAX_BACKLOG) if self._load_rows is None else self._load_rows
                if n < start:  # the log was cut (a resumed run): the rows after the cut come again
                    start = max(0, n - MAX_BACKLOG)
                block = run.load_log.read(start, n)
                layout = run.load_log.layout
        records = load_records(layout, block) if layout is not None else []
        return Update(rows, list(enumerate(records, start)), alerts)

    # ------------------------------------------------------------------ publishing (the event loop)
    async def _run(self) -> None:
        try:
            while self.subscribers:
                update = await asyncio.to_thread(self._read)
                self.reads += 1
                self._publish(update)
                self.ready.set()
                if not self.subscribers:
                    break
                await asyncio.sleep(self.poll_seconds)
        finally:
            self.ready.set()  # a subscriber waiting on a failed first read is not left hanging
            self._on_idle(self)

    def _publish(self, update: Update) -> None:
        if update.rows:
            self._seq = update.rows[-1][0]
            self.rows.extend(update.rows)
        if update.routing:
            self.loads.extend(update.routing)
        self._load_rows = update.routing[-1][0] + 1 if update.routing else (self._load_rows or 0)
        self.alerts = update.alerts
        now = asyncio.get_running_loop().time()
        if not (update.rows or update.routing):
            if now - self._quiet_since >= KEEPALIVE_SECONDS:
                self._quiet_since = now
                for sub in self.subscribers:
                    if sub.joined:
                        sub.queue.put_nowait(KEEPALIVE)
            return
        self._backlog = None
        self._quiet_since = now
        first_step = min((row["step"] for _, row in update.rows), default=np.inf)
        for sub in list(self.subscribers):
            if not sub.joined:
                continue
            if first_step > sub.since:  # keeps every row: the message encoded once serves it
                if update.message is None:
                    update.message = encode(
                        [row for _, row in update.rows], [r for _, r in update.routing], update.alerts
                    )
                message = update.message
            else:
                message = encode(
                    [row for _, row in update.rows if row["step"] > sub.since],
                    [r for _, r in update.routing],
                    update.alerts,
                )
            if sub.queue.qsize() >= MAX_QUEUED:  # a client that stopped reading: let it go, it reconnects
                self.subscribers.discard(sub)
                sub.queue.put_nowait(None)
                continue
            sub.queue.put_nowait(message)

    # ------------------------------------------------------------------ subscribers
    async def join(self, sub: Subscriber) -> bytes | None:
        """Add ``sub`` and return its backlog (None: nothing to send yet); updates after it go to its queue."""
        self.subscribers.add(sub)
        await self.ready.wait()
        if sub not in self.subscribers:  # the feed failed or let it go meanwhile
            sub.queue.put_nowait(None)
            return None
        # no await from here to `joined`: no update is published in between
        sub.joined = True
        return self.backlog(sub.since)

    def backlog(self, since: float) -> bytes | None:
        """The kept rows after ``since``, encoded once for every joiner that asks for the same rows until the
        next update (a crowd opening the page at once asks 200 times for one backlog)."""
        rows = [row for _, row in self.rows if row["step"] > since]
        loads = [r for _, r in self.loads if r["step"] > since]
        key = (len(rows), len(loads), id(rows[0]) if rows else None, id(loads[0]) if loads else None)
        if self._backlog is None or self._backlog[0] != key:
            self._backlog = (key, encode(rows, loads, self.alerts) if rows or loads else None)
        return self._backlog[1]

    def leave(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)


class Feeds:
    """The running feeds of a server, one per watched run."""

    def __init__(self, poll_seconds: float) -> None:
        self.poll_seconds = poll_seconds
        self.feeds: dict[str, RunFeed] = {}

    def feed(self, run: RunData) -> RunFeed:
        feed = self.feeds.get(run.id)
        if feed is None:
            feed = self.feeds[run.id] = RunFeed(run, self.poll_seconds, self._idle)
        return feed

    def _idle(self, feed: RunFeed) -> None:
        if self.feeds.get(feed.run.id) is feed:
            del self.feeds[feed.run.id]
        for sub in list(feed.subscribers):  # the feed stopped (an error): its streams end, clients reconnect
            sub.queue.put_nowait(None)
        feed.subscribers.clear()
