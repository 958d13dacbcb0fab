"""The dashboard's web server: JSON endpoints for history, server-sent events for live runs, the built app.

    app = create_app(["./.moe_lab/runs"], token=None)      # uvicorn.run(app, host="127.0.0.1", port=8765)

Read-only: it never writes into a run. Every request names a run by the opaque id from ``/api/runs``, never by
a path (see `runs.py`). With a token set, every request must carry it (``Authorization: Bearer``, the
``token`` query parameter, which the app passes on, or the cookie set when the page was opened with it).

Endpoints (all GET):
    /api/runs                                   runs under the roots (newest first, live ones marked) + MLflow
    /api/mlflow/{run_id}, /scalars?keys=...     an MLflow run's metrics and their history (with --mlflow)
    /api/runs/{id}                              summary: metrics present, MoE layers, experts, alerts
    /api/runs/{id}/config, /checkpoints         the training config and checkpoint list
    /api/runs/{id}/scalars?keys=a,b&points=N    metric series (bucket mean/min/max when longer than N)
    /api/runs/{id}/inference?points=N           an inference run's figures (none for a training run, and why)
    /api/runs/{id}/ranks?points=N               per rank of a distributed run: its own figures
    /api/runs/{id}/routing?layer=L&points=N     expert shares [steps x experts], drop rate, entropy, max/mean, bias
                          (&encoding=u16: the shares as base64 uint16, as the app asks for them)
    /api/runs/{id}/routing/header               the load log's MoE layers and experts (no event-file read)
    /api/runs/{id}/routing/now                  the last logged shares, [layers x experts]
    /api/runs/{id}/stream                       server-sent events: each new event-file row and load row
                          (one reader per run for all its streams: `dashboard.live`)
    /api/runs/{id}/specialization, /cost        the saved router profile and cost report (numbers only)
    /api/runs/{id}/prompt-routing?wait=S        the run's model routing the project's prompt set: per prompt,
                          token and MoE layer the top-k experts and weights (202 while it computes)
"""

from __future__ import annotations

import base64
import hmac
from pathlib import Path

import numpy as np
import orjson
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders

from dashboard import analysis, mlflow_runs
from dashboard.live import Feeds, Subscriber
from dashboard.prompt_routing import NoModelError, PromptRoutingCache
from dashboard.runs import RunData, RunRegistry, downsample_series
from moe_core.errors import MoELabError
from moe_core.train.load_log import LAYER_STATS

STATIC = Path(__file__).parent / "static"
TOKEN_ENV = "MOE_LAB_DASHBOARD_TOKEN"
POLL_SECONDS = 0.2  # how often a watched run is read for new rows (the latency floor)
MAX_POINTS = 4000
INFERENCE_KEYS = ("tokens_per_s", "cache_hit_rate", "rerouted_tokens", "experts_resident", "tokens")
PROMPT_ROUTING_WAIT_S = 10.0  # how long a request waits for the token-to-expert view before "computing"


def create_app(
    roots: list[str | Path],
    token: str | None = None,
    mlflow_uri: str | None = None,
    poll_seconds: float = POLL_SECONDS,
) -> FastAPI:
    registry = RunRegistry(roots)
    app = FastAPI(title="moe-lab dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = registry

    app.add_middleware(TokenAndHeaders, token=token)

    def run_or_404(rid: str) -> RunData:
        run = registry.get(rid)
        if run is None:
            raise HTTPException(404, f"no run with id {rid!r} under the dashboard's runs roots")
        return run

    # ------------------------------------------------------------------ runs
    @app.get("/api/runs")
    def list_runs():
        found = registry.scan()
        runs = [r.listing() for r in found]
        listed = []
        if mlflow_uri:
            local = {r.mlflow_run_id(): r.id for r in found if r.mlflow_run_id()}
            listed = mlflow_runs.list_runs(mlflow_uri, local)
        return {"roots": [str(r) for r in registry.roots], "runs": runs, "mlflow": listed}

    def mlflow_or_404(run_id: str) -> str:
        if not mlflow_uri:
            raise HTTPException(404, "the dashboard was started without --mlflow")
        if not mlflow_runs.RUN_ID.match(run_id):
            raise HTTPException(404, f"not an MLflow run id: {run_id!r}")
        return mlflow_uri

    @app.get("/api/mlflow/{run_id}")
    def mlflow_summary(run_id: str):
        return mlflow_runs.run_summary(mlflow_or_404(run_id), run_id)

    @app.get("/api/mlflow/{run_id}/scalars")
    def mlflow_scalars(run_id: str, keys: str = "loss", points: int = Query(1000, ge=2, le=MAX_POINTS)):
        uri = mlflow_or_404(run_id)
        return FastJSON(
            {
                "run": run_id,
                "x": "step",
                "series": mlflow_runs.metric_history(uri, run_id, keys.split(",")[:32], points),
            }
        )

    @app.get("/api/runs/{rid}")
    def summary(rid: str):
        return run_or_404(rid).summary()

    @app.get("/api/runs/{rid}/config")
    def config(rid: str):
        return {"config": run_or_404(rid).config()}

    @app.get("/api/runs/{rid}/checkpoints")
    def checkpoints(rid: str):
        return {"checkpoints": run_or_404(rid).checkpoints()}

    @app.get("/api/runs/{rid}/scalars")
    def scalars(
        rid: str,
        keys: str = "loss",
        points: int = Query(1000, ge=2, le=MAX_POINTS),
        start: float | None = None,
        end: float | None = None,
        x: str = "step",
    ):
        return FastJSON({"run": rid, "x": x, "series": _series(run_or_404(rid), keys, points, start, end, x)})

    @app.get("/api/runs/{rid}/inference")
    def inference(rid: str, points: int = Query(2000, ge=2, le=MAX_POINTS)):
        """The Inference page's figures, from an inference run's events (``inference.jsonl``) only: a
        training run's tokens/s are training figures, and it has none of these."""
        run = run_or_404(rid)
        if run.kind != "inference":
            return {
                "run": rid,
                "kind": run.kind,
                "series": {},
                "message": f"{run.name} is a training run: it has no inference events; moe-lab generate "
                "MODEL --events RUNS/serving ... writes them into a run of their own.",
            }
        series = _series(run, ",".join(INFERENCE_KEYS), points, None, None, "step")
        return FastJSON({"run": rid, "kind": run.kind, "series": series, "message": None})

    @app.get("/api/runs/{rid}/ranks")
    def ranks(rid: str, points: int = Query(1000, ge=2, le=MAX_POINTS)):
        """Each rank's own figures of a distributed run (all-to-all time and bytes per rank; a rank's event
        file where it writes one), downsampled like `scalars`."""
        run = run_or_404(rid)
        out = []
        for rank, columns in sorted(run.rank_columns().items()):
            series = {}
            for key, col in columns.items():
                steps, values = _last_per_step(np.asarray(col.steps), np.asarray(col.values))
                series[key] = downsample_series(steps, values, points)
            out.append({"rank": rank, "series": series})
        return FastJSON({"run": rid, "ranks": out})

    @app.get("/api/runs/{rid}/routing")
    def routing(
        rid: str,
        layer: int = 0,
        points: int = Query(600, ge=2, le=MAX_POINTS),
        start: float | None = None,
        end: float | None = None,
        encoding: str = Query("json", pattern="^(json|u16)$"),
    ):
        run = run_or_404(rid)
        layout, rows, steps = run.sidecar()
        if layout is None:
            raise HTTPException(404, f"run {run.name} has no routing load log (routing_loads.f32)")
        if layer not in layout.layers:
            raise HTTPException(
                404, f"layer {layer} is not an MoE layer of {run.name}: {list(layout.layers)}"
            )
        lo, hi = _row_range(steps, start, end)
        edges, means = run.load_buckets(rows, lo, hi, points)  # every layer at once, cached for the next
        columns = layout.layer_columns(means, layer)  # float32: shortest text, NaN -> null
        out = {
            "run": rid,
            "layer": layer,
            "experts": layout.experts,
            "rows": int(hi - lo),
            "steps": steps[lo:hi][edges] if len(edges) else [],
            "frac": columns["frac"],
        }
        if encoding == "u16":  # the heatmap as 2 bytes a cell instead of ~12 characters of JSON
            out["frac"] = _u16(columns["frac"])
        for name in LAYER_STATS:
            out[name] = columns[name]
        if layout.has_bias:
            out["bias"] = columns["bias"]
        return FastJSON(out)

    @app.get("/api/runs/{rid}/routing/header")
    def routing_header(rid: str):
        """The load log's layout (MoE layers, experts, bias or not) without reading the event file: what the
        Routing page needs to ask for its layers while the summary is still being read."""
        run = run_or_404(rid)
        layout, rows, _ = run.sidecar()
        if layout is None:
            return {"run": rid, "layers": [], "experts": 0, "has_bias": False, "rows": 0}
        return {
            "run": rid,
            "layers": list(layout.layers),
            "experts": layout.experts,
            "has_bias": layout.has_bias,
            "rows": int(rows.shape[0]),
        }

    @app.get("/api/runs/{rid}/routing/now")
    def routing_now(rid: str):
        run = run_or_404(rid)
        layout, rows, _ = run.sidecar()
        if layout is None or rows.shape[0] == 0:
            return {"run": rid, "step": None, "layers": list(layout.layers) if layout else [], "frac": []}
        last = layout.decode(np.array(rows[-1:], dtype=np.float32))
        return FastJSON(
            {
                "run": rid,
                "step": float(last["step"][0]),
                "layers": list(layout.layers),
                "frac": last["frac"][0],
            }
        )

    # ------------------------------------------------------------------ analysis
    @app.get("/api/runs/{rid}/specialization")
    def specialization(rid: str):
        return {"run": rid, "profile": analysis.specialization(run_or_404(rid))}

    prompt_routing_cache = PromptRoutingCache()

    @app.get("/api/runs/{rid}/prompt-routing")
    def prompt_routing(rid: str, wait: float = Query(PROMPT_ROUTING_WAIT_S, ge=0, le=60)):
        """The token-to-expert view of the run's model (`dashboard.prompt_routing`): 404 without a model,
        409 when it cannot route the prompt set (no tokenizer), 202 while it is computed."""
        run = run_or_404(rid)
        try:
            view = prompt_routing_cache.get(run, wait)
        except NoModelError as err:
            raise HTTPException(404, str(err)) from None
        except MoELabError as err:
            raise HTTPException(409, f"run {run.name!r}: {err}") from None
        if view is None:
            return JSONResponse({"run": rid, "status": "computing"}, status_code=202)
        return FastJSON({"run": rid, "status": "done", **view})

    @app.get("/api/runs/{rid}/cost")
    def cost(rid: str):
        run = run_or_404(rid)
        run.refresh()
        latest = {
            k: run.tail.columns[k].values[-1]
            for k in ("flops_per_token", "tokens_per_s", "mfu", "tflops_per_device", "tokens")
            if k in run.tail.columns and run.tail.columns[k].values
        }
        return {"run": rid, "report": analysis.cost(run), "training": latest}

    # ------------------------------------------------------------------ live
    feeds = app.state.feeds = Feeds(poll_seconds)  # one reader per watched run, whatever its streams

    @app.get("/api/runs/{rid}/stream")
    async def stream(rid: str, since: float = -1.0):
        run = run_or_404(rid)

        async def events():
            feed, sub = feeds.feed(run), Subscriber(since)
            try:
                backlog = await feed.join(sub)
                yield b"retry: 1000\n\n"
                if backlog:
                    yield backlog
                while (message := await sub.queue.get()) is not None:  # None: the feed let it go
                    yield message
            finally:
                feed.leave(sub)

        return EventStream(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    # ------------------------------------------------------------------ the app
    @app.get("/")
    def index():
        return _static_file("index.html")

    @app.get("/assets/{name}")
    def asset(name: str):
        return _static_file(f"assets/{name}")

    return app


class TokenAndHeaders:
    """With a token set, every request must carry it; every response gets the no-sniff and no-store headers.
    A plain ASGI middleware: `BaseHTTPMiddleware` (``@app.middleware``) passes each message of a live
    stream through an extra task and queue, which 200 streams on one run pay for at every update."""

    def __init__(self, app, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        token, cookie = self.token, None
        if token:
            given = (
                request.headers.get("authorization", "").removeprefix("Bearer ").strip()
                or request.query_params.get("token")
                or request.cookies.get("moe_lab_token")
                or ""
            )
            if not hmac.compare_digest(given.encode(), token.encode()):
                denied = JSONResponse(
                    {"detail": "a dashboard token is required (?token=... or Authorization: Bearer ...)"},
                    status_code=401,
                )
                await denied(scope, receive, send)
                return
            if request.query_params.get("token"):  # the page opened with it: later requests carry the cookie
                cookie = Response()
                cookie.set_cookie("moe_lab_token", token, httponly=True, samesite="strict")

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["X-Content-Type-Options"] = "nosniff"
                headers["Cache-Control"] = "no-store"
                if cookie is not None:
                    headers.append("set-cookie", cookie.headers["set-cookie"])
            await send(message)

        await self.app(scope, receive, send_with_headers)


class EventStream(StreamingResponse):
    """A server-sent event stream whose generator is closed when the response ends, however it ends: a client
    that left while a message was being written leaves the generator at a ``yield``, and its ``finally``
    (leaving the run's feed) would otherwise wait for garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class FastJSON(Response):
    """JSON through orjson, numpy arrays included (NaN becomes null): a 600 x 128 heatmap in milliseconds,
    where the default encoder takes half a second."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY, default=_contiguous)


U16_NULL = 65535  # u16 encoding: shares in [0, 1] as round(share * 65534); 65535 is a missing value


def _u16(shares: np.ndarray) -> dict:
    """``[rows, E]`` shares as little-endian uint16, base64: what the browser's heatmap needs, 1/65534 steps."""
    q = np.where(np.isfinite(shares), np.round(np.clip(shares, 0.0, 1.0) * (U16_NULL - 1)), U16_NULL)
    return {
        "encoding": "u16",
        "shape": list(shares.shape),
        "scale": U16_NULL - 1,
        "null": U16_NULL,
        "data": base64.b64encode(q.astype("<u2").tobytes()).decode(),
    }


def _contiguous(obj):
    if isinstance(obj, np.ndarray):  # a column slice: orjson serializes C-contiguous arrays only
        return np.ascontiguousarray(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def _static_file(rel: str) -> Response:
    """A file of the built app: only names the build produced (a fixed listing), never a joined path."""
    allowed = {p.relative_to(STATIC).as_posix(): p for p in STATIC.rglob("*") if p.is_file()}
    path = allowed.get(rel)
    if path is None:
        raise HTTPException(
            404,
            "not found"
            if rel != "index.html"
            else "the dashboard's built app is missing (dashboard/static); run npm run build in "
            "dashboard/web",
        )
    return FileResponse(path)


def _series(run: RunData, keys: str, points: int, start: float | None, end: float | None, x: str) -> dict:
    """Metric series of a run's event file, by step (or tokens seen), downsampled to ``points``."""
    run.refresh()
    out = {}
    tokens = run.tail.columns.get("tokens")
    for key in keys.split(",")[:32]:
        col = run.tail.columns.get(key)
        if col is None:
            continue
        steps, values = _last_per_step(np.asarray(col.steps), np.asarray(col.values))
        keep = _in_range(steps, start, end)
        series = downsample_series(steps[keep], values[keep], points)
        if x == "tokens" and tokens is not None:  # align by tokens seen: map steps through the tokens column
            series["x"] = np.interp(series["x"], tokens.steps, tokens.values).tolist()
        out[key] = series
    return out


def _last_per_step(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted by step, the last row for each step: a resumed run logs the steps after its checkpoint again."""
    if len(steps) < 2 or np.all(np.diff(steps) > 0):
        return steps, values
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    last = np.append(steps[1:] != steps[:-1], True)
    return steps[last], values[last]


def _in_range(steps: np.ndarray, start: float | None, end: float | None) -> np.ndarray:
    keep = np.ones(len(steps), dtype=bool)
    if start is not None:
        keep &= steps >= start
    if end is not None:
        keep &= steps <= end
    return keep


def _row_range(steps: np.ndarray, start: float | None, end: float | None) -> tuple[int, int]:
    lo = 0 if start is None else int(np.searchsorted(steps, start, side="left"))
    hi = len(steps) if end is None else int(np.searchsorted(steps, end, side="right"))
    return lo, max(lo, hi)
