"""The live dashboard: telemetry-to-browser latency, its cost to training throughput, and the load time of a
long run.

1. Latency: a real training run (``--preset``, one log row per step) with the dashboard serving it and
   headless Chromium (Debian's /usr/bin/chromium via Playwright) on its Routing page; for every row, the
   time from the trainer writing it (its ``time`` field) to the page's EventSource receiving it. p50/p95,
   target p95 < 1 s.
2. Throughput cost: the same training with and without a connected dashboard (browser on the Routing page,
   live updates on), interleaved ``--rounds`` times in alternating order; the median of each round's
   paired cost (1 - watched/plain), and their range as the noise. Target: < 2% slower.
3. Load time: a synthetic run of ``--load-steps`` steps x 24 MoE layers x 128 experts logged every
   ``--load-log-every`` steps (the event file without per-expert keys, as `log.per_expert=false` writes it,
   plus the binary load log with every share); the time for a browser to open its Routing page with all 24
   layer heatmaps drawn (a fresh server: nothing cached), and the server-side time of the same requests.
   Target < 2 s.

Prints a table, then ONE JSON line of the figures.

    python benchmarks/dashboard.py                      # mixtral-tiny, 80 steps x 4 rounds, 100k-step load
    python benchmarks/dashboard.py --load-log-every 1   # the load test with a row for every one of 100k steps
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as `python benchmarks/dashboard.py`, this file's folder comes first on sys.path and its name would
# shadow the `dashboard` package it measures
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import psutil
import torch
from playwright.sync_api import sync_playwright

from dashboard.cli import start_beside
from moe_core.train import TrainConfig, read_jsonl
from moe_core.train.load_log import LAYER_STATS, SIDECAR, SIDECAR_HEADER, LoadLogLayout
from moe_core.train.loop import Trainer

CHROMIUM = os.environ.get(
    "MOE_LAB_CHROMIUM", "/usr/bin/chromium"
)  # Debian's; .ci/run installs it when missing


def train_config(args, steps: int) -> TrainConfig:
    return TrainConfig.build(
        {
            "model": {"preset": args.preset},
            "steps": steps,
            "batch_size": args.batch,
            "data": {"source": "synthetic", "seq_len": args.seq, "synthetic_blocks": 256},
            "optim": {"warmup_steps": 2},
            "log": {"every": 1, "progress": "off"},
            "checkpoint": {"every": 10**9, "export": False},
            "eval": {"every": 0, "batches": 1},
        }
    )


class Gate:
    """A metrics sink that holds the trainer at its first logging step until ``opened`` is set: the page is
    then open and connected before the timed steps, so its load (a one-off) is not charged to the steady
    state. The wait falls outside the steps' own timing (``step_time_s`` covers the step only)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.first = threading.Event()  # the run's first row is written: the dashboard can list it

    def log(self, step: int, metrics: dict) -> None:
        self.first.set()
        if not self.opened.wait(120):
            raise RuntimeError("the dashboard page did not open within 120 s")

    def close(self) -> None:
        self.first.set()


def run_training(args, out: Path, steps: int, gate: Gate | None = None) -> list[dict]:
    trainer = Trainer(train_config(args, steps), out, sinks=[gate] if gate else None)
    try:
        trainer.run()
    finally:
        trainer.close()
    return read_jsonl(out / "metrics.jsonl")


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds these processes used so far (each counted once)."""
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def run_id(url: str, name: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in json.load(urllib.request.urlopen(url + "api/runs"))["runs"]:
            if r["name"] == name:
                return r["id"]
        time.sleep(0.05)
    raise RuntimeError(f"the dashboard did not list {name}")


def own_browser() -> list[psutil.Process]:
    """This benchmark's Chromium processes (under its Playwright driver), not other users' browsers."""
    return [p for p in psutil.Process().children(recursive=True) if "chrom" in p.name()]


# ------------------------------------------------------------------------------------------- 1 + 2
RECORD_JS = """(id) => {
  // rows written after the stream opened only: earlier ones measure the page load, not the latency
  window.__received = [];
  const es = new EventSource(`/api/runs/${id}/stream?since=-1`);
  let opened = Infinity;
  window.__opened = 0;
  es.addEventListener('open', () => { opened = Date.now(); window.__opened = opened; });
  es.addEventListener('update', (ev) => {
    const now = Date.now();
    for (const row of JSON.parse(ev.data).rows) if (row.time * 1000 >= opened) window.__received.push([row.time, now]);
  });
}"""


def live_round(args, workdir: Path, name: str, with_dashboard: bool, browser) -> dict:
    out = workdir / name
    out.mkdir(parents=True)
    latencies: list[float] = []
    cpu: dict[str, float] = {}
    gate = Gate()
    if not with_dashboard:
        gate.opened.set()
        rows = run_training(args, out, args.steps, gate)
    else:
        proc, url = start_beside([workdir], port=0)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            result: dict = {}
            thread = threading.Thread(
                target=lambda: result.update(rows=run_training(args, out, args.steps, gate))
            )
            thread.start()
            gate.first.wait(120)
            rid = run_id(url, name)
            page.goto(f"{url}#/routing/{rid}")
            page.wait_for_function(
                "[...document.querySelectorAll('.heatmap[data-title*=\"expert load\"]')]"
                ".some(e => +e.dataset.columns > 0)",
                timeout=120000,
            )
            page.evaluate(RECORD_JS, rid)
            page.wait_for_function("window.__opened > 0", timeout=60000)
            server, browser_procs = tree(proc.pid), own_browser()
            before = {"server": cpu_seconds(server), "browser": cpu_seconds(browser_procs)}
            t0 = time.perf_counter()
            gate.opened.set()
            thread.join()
            wall = time.perf_counter() - t0
            cpu = {
                "server": (cpu_seconds(server) - before["server"]) / wall,
                "browser": (cpu_seconds(browser_procs) - before["browser"]) / wall,
            }
            time.sleep(1.0)  # the last rows' events
            received = page.evaluate("window.__received")
            page.close()
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        rows = result["rows"]
        latencies = [(now_ms / 1000.0 - wrote) for wrote, now_ms in received]
    timed = [r for r in rows if r["step"] > args.skip]
    tokens = sum(r["step_time_s"] * r["tokens_per_s"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    return {"tokens_per_s": tokens / seconds, "latencies": latencies, "cpu": cpu}


# ------------------------------------------------------------------------------------------- 3
def synthetic_run(out: Path, steps: int, every: int, layers: int = 24, experts: int = 128) -> dict:
    """A run directory as the trainer writes it, without training: metrics.jsonl and the binary load log."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    layer_ids = list(range(layers))
    header = LoadLogLayout(tuple(layer_ids), experts, has_bias=False).header()
    (out / SIDECAR_HEADER).write_text(json.dumps(header))
    logged = np.arange(every, steps + 1, every)
    width = header["row_floats"]
    chunk = 2000
    with open(out / SIDECAR, "wb") as f, open(out / "metrics.jsonl", "wb") as m:
        for start in range(0, len(logged), chunk):
            steps_N = logged[start : start + chunk]
            n = len(steps_N)
            logits_NLE = rng.normal(size=(n, layers, experts)).astype(np.float32)
            shares_NLE = np.exp(logits_NLE) / np.exp(logits_NLE).sum(-1, keepdims=True)
            stats_NLS = np.stack(
                [
                    rng.uniform(0, 0.05, (n, layers)),
                    rng.uniform(4, 4.8, (n, layers)),
                    shares_NLE.max(-1) * experts,
                ],
                -1,
            ).astype(np.float32)
            rows = np.zeros((n, width), np.float32)
            rows[:, 0], rows[:, 1] = steps_N, steps_N * 4096
            rows[:, 2:] = np.concatenate([shares_NLE, stats_NLS], -1).reshape(n, -1)
            f.write(rows.tobytes())
            lines = []
            for i, step in enumerate(steps_N.tolist()):
                row = {
                    "step": step,
                    "time": 1.7e9 + step,
                    "loss": 3 + 1 / (1 + step / 1000),
                    "lm_loss": 3.0,
                    "aux_loss": 0.01,
                    "z_loss": 0.001,
                    "grad_norm": 1.0,
                    "lr": 3e-4,
                    "tokens_per_s": 1e5,
                    "step_time_s": 0.04,
                    "tokens": step * 4096.0,
                    "flops_per_token": 1e9,
                    "mfu": 0.4,
                    "tflops_per_device": 100.0,
                    "skipped_steps": 0.0,
                }
                for li in layer_ids:
                    for s, key in enumerate(LAYER_STATS):
                        row[f"moe/layer_{li}/{key}"] = float(stats_NLS[i, li, s])
                lines.append(orjson.dumps(row))
            m.write(b"\n".join(lines) + b"\n")
    return {
        "rows": len(logged),
        "load_log_mb": (out / SIDECAR).stat().st_size / 2**20,
        "events_mb": (out / "metrics.jsonl").stat().st_size / 2**20,
    }


def load_time(args, workdir: Path, browser) -> dict:
    root = workdir / "load"
    sizes = synthetic_run(root / "long-run", args.load_steps, args.load_log_every)
    out = {**sizes}
    # server side, a fresh server: the requests the Run and Routing pages make
    proc, url = start_beside([root], port=0)
    try:
        rid = run_id(url, "long-run")
        t0 = time.perf_counter()
        summary = json.load(urllib.request.urlopen(f"{url}api/runs/{rid}"))
        urllib.request.urlopen(
            f"{url}api/runs/{rid}/scalars?keys=loss,lm_loss,aux_loss,z_loss,lr,grad_norm,"
            "tokens_per_s,mfu,skipped_steps,val_loss,step_time_s,tokens&points=2000"
        ).read()
        with ThreadPoolExecutor(6) as pool:  # a browser opens about 6 connections per host
            list(
                pool.map(
                    lambda layer: urllib.request.urlopen(
                        f"{url}api/runs/{rid}/routing?layer={layer}&points=600&encoding=u16"
                    ).read(),
                    summary["layers"],
                )
            )
        out["server_s"] = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    # in the browser, another fresh server: navigation to all 24 heatmaps drawn
    proc, url = start_beside([root], port=0)
    try:
        rid = run_id(url, "long-run")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        t0 = time.perf_counter()
        page.goto(f"{url}#/routing/{rid}")
        page.wait_for_function(
            "document.querySelectorAll('.heatmap[data-title*=\"expert load\"]').length === 24 && "
            "[...document.querySelectorAll('.heatmap[data-title*=\"expert load\"]')]"
            ".every(e => +e.dataset.columns > 0)",
            timeout=120000,
        )
        out["browser_routing_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        page.goto(f"{url}#/run/{rid}")
        page.wait_for_function(
            "+document.querySelector('.chart[data-title=\"loss\"]')?.dataset.points > 0", timeout=120000
        )
        out["browser_run_s"] = time.perf_counter() - t0
        page.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mixtral-tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of tokens/s")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load-steps", type=int, default=100_000)
    ap.add_argument("--load-log-every", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        workdir = Path(tmp)
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        plain, watched, latencies, cpu = [], [], [], []
        for r in range(args.rounds):  # interleaved, the order alternating, so machine drift hits both alike
            for is_watched in (False, True) if r % 2 == 0 else (True, False):
                got = live_round(
                    args, workdir, f"{'watched' if is_watched else 'plain'}-{r}", is_watched, browser
                )
                if not is_watched:
                    plain.append(got["tokens_per_s"])
                    continue
                watched.append(got["tokens_per_s"])
                latencies += got["latencies"]
                cpu.append(got["cpu"])
        load = load_time(args, workdir, browser) if args.load_steps else {}
        browser.close()
    lat = np.array(latencies)
    costs = [1 - w / p for p, w in zip(plain, watched)]
    result = {
        "benchmark": "dashboard",
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "latency_rows": int(lat.size),
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p95_s": float(np.percentile(lat, 95)),
        "latency_max_s": float(lat.max()),
        "tokens_per_s_plain": statistics.median(plain),
        "tokens_per_s_watched": statistics.median(watched),
        # each round's pair measured back to back: the median of the paired costs, and their range as the noise
        "throughput_cost": statistics.median(costs),
        "throughput_cost_range": [min(costs), max(costs)],
        "tokens_per_s_rounds": [[round(a), round(b)] for a, b in zip(plain, watched)],
        "cores_used_server": statistics.median(c["server"] for c in cpu),
        "cores_used_browser": statistics.median(c["browser"] for c in cpu),
        "load_steps": args.load_steps,
        "load_log_every": args.load_log_every,
        **{f"load_{k}": v for k, v in load.items()},
    }
    print(
        f"latency write->browser: p50 {result['latency_p50_s'] * 1000:.0f} ms, p95 {result['latency_p95_s'] * 1000:.0f} ms "
        f"over {lat.size} rows (target p95 < 1 s)"
    )
    print(
        f"training tokens/s: plain {result['tokens_per_s_plain']:.0f}, with dashboard {result['tokens_per_s_watched']:.0f}"
        f" -> cost {100 * result['throughput_cost']:.1f}% (median of the rounds' paired costs, which range "
        f"{100 * min(costs):.1f}% to {100 * max(costs):.1f}%; target < 2%); rounds: {[round(x) for x in plain]} vs "
        f"{[round(x) for x in watched]}"
    )
    print(
        f"while watched, CPU cores busy (median of rounds): server {result['cores_used_server']:.3f}, "
        f"browser {result['cores_used_browser']:.3f}"
    )
    if load:
        print(
            f"load {args.load_steps} steps x 24 layers x 128 experts, every {args.load_log_every} "
            f"({load['rows']} rows, {load['load_log_mb']:.0f} MB load log, {load['events_mb']:.0f} MB events): server "
            f"{load['server_s']:.2f} s, browser Routing {load['browser_routing_s']:.2f} s, Run {load['browser_run_s']:.2f} s "
            f"(target < 2 s)"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
