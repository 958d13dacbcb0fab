"""Training step time of an MoE model against its dense baselines, and a short quality run.

1. Step time: full optimizer steps (forward, backward, clip, AdamW, router bias update) of
   ``moe`` (the preset), ``dense-active`` (a dense FFN as wide as the K active experts) and ``dense-total``
   (as wide as all E experts), interleaved round by round so machine noise hits all alike; synthetic tokens.
   Target on CPU: moe step time <= 1.2x dense-active (the charter's < 20% overhead).
2. Quality: ``moe`` and ``dense-active`` trained on the built-in corpus for the same tokens, then validation
   loss and perplexity side by side (Switch Transformer, Fedus et al. 2021: MoE lower at equal active
   compute and tokens).

3. EP scaling (``--ep-scaling 1,2,4``): the same global batch trained by ``moe-lab train --nproc N`` with
   ``parallel.ep_size=N`` (experts sharded over all N processes; gloo on CPU, NCCL on GPUs), for each N in
   turn; median step time, tokens/s and the communication telemetry (all-to-all ms and bytes per rank, share
   of the step) from the run's ``metrics.jsonl``. The first ``--warmup`` steps are left out.

``--compile`` adds ``moe-compiled`` (``compile=true``: the routed experts, `moe_core.experts.impl_under_capture`)
and ``moe-compiled-static`` (compiled with ``expert_impl=static``, every expert on every token: what ``auto``
took under torch.compile before 2026-11-27), interleaved with the rest; their warm-up steps compile.

``--expert-impl IMPL`` (repeatable) adds ``moe-IMPL``: the MoE step with that expert path instead of ``auto``'s.

In bf16 on a CPU, oneDNN compiles a kernel for each matmul shape and keeps 1024 of them
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``); the experts' row counts change at every step, and trainers interleaved on
the same tokens route alike, so a later variant finds the kernels an earlier one just compiled and the first one
pays for them (olmoe-small: the same config 523 ms first, 293 ms fourth). Time bf16 variants in separate runs.

Prints a table, then ONE JSON line of the figures.

    python benchmarks/train_step.py                                  # switch-small, batch 8 x seq 128
    python benchmarks/train_step.py --preset mixtral-small --quality-steps 0   # step time only
    python benchmarks/train_step.py --ep-scaling 1,2,4 --preset mixtral-small --rounds 20   # EP scaling
    python benchmarks/train_step.py --preset olmoe-small --compile --quality-steps 0   # compiled steps too
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_core.config import parameter_counts
from moe_core.train import TrainConfig, read_jsonl
from moe_core.train.loop import Trainer


def config_for(args, baseline: str | None, steps: int, source: str, **fields) -> TrainConfig:
    """The run's config; ``fields``: top-level fields of a variant (``compile``, ``model``'s ``overrides``)."""
    overrides = fields.pop("overrides", {})
    return TrainConfig.build(
        {
            "model": {"preset": args.preset, "baseline": baseline, "overrides": overrides},
            "data": {
                "source": source,
                "seq_len": args.seq,
                "max_documents": args.max_documents,
                "synthetic_blocks": max(64, args.batch * 4),
            },
            "steps": steps,
            "batch_size": args.batch,
            "precision": args.precision,
            "device": args.device,
            "optim": {"lr": args.lr, "warmup_steps": max(1, steps // 10)},
            "eval": {"every": 0, "batches": args.eval_batches},
            "log": {"every": max(1, steps // 5), "progress": "off"},
            "checkpoint": {"every": 10**9, "export": False},
            **fields,
        }
    )


def step_times(args, workdir: Path) -> dict[str, dict]:
    variants = {"moe": (None, {}), "dense-active": ("active", {}), "dense-total": ("total", {})}
    if args.compile:  # compile=true, and the same with every expert on every token (auto's choice before)
        variants["moe-compiled"] = (None, {"compile": True})
        variants["moe-compiled-static"] = (None, {"compile": True, "overrides": {"expert_impl": "static"}})
    for impl in args.expert_impl:  # the MoE step with auto's choice replaced
        variants[f"moe-{impl}"] = (None, {"overrides": {"expert_impl": impl}})
    trainers = {
        name: Trainer(config_for(args, b, 10**6, "synthetic", **fields), workdir / f"speed-{name}")
        for name, (b, fields) in variants.items()
    }
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.train_step()
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.train_step()
            if trainer.state.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, trainer in trainers.items():
        counts = parameter_counts(trainer.model_config)
        median = statistics.median(times[name])
        out[name] = {
            "step_s": median,
            "tokens_per_s": args.batch * args.seq / median,
            "params_total": counts["total"],
            "params_active": counts["active"],
        }
        trainer.close()
    return out


def quality(args, workdir: Path) -> dict[str, dict]:
    out = {}
    for name, baseline in (("moe", None), ("dense-active", "active")):
        config = config_for(args, baseline, args.quality_steps, "builtin")
        trainer = Trainer(config, workdir / f"quality-{name}")
        t0 = time.perf_counter()
        result = trainer.run()
        trainer.close()
        out[name] = {
            "val_loss": result.val_loss,
            "val_ppl": math.exp(result.val_loss),
            "train_loss": result.loss,
            "tokens": result.tokens,
            "wall_s": time.perf_counter() - t0,
        }
    return out


def ep_scaling(args, workdir: Path) -> dict[int, dict]:
    """One `moe-lab train` run per process count, experts sharded over all processes; medians of its steps."""
    out = {}
    for n in args.ep_scaling:
        run = workdir / f"ep{n}"
        steps = args.warmup + args.rounds
        sets = [
            f"steps={steps}",
            f"batch_size={args.batch}",
            f"data.seq_len={args.seq}",
            "data.source=synthetic",
            f"data.synthetic_blocks={max(64, args.batch * 4)}",
            f"precision={args.precision}",
            f"device={args.device}",
            "log.every=1",
            "log.progress=off",
            "checkpoint.every=1000000000",
            "checkpoint.export=false",
            "eval.batches=1",
            f"parallel.ep_size={n}",
        ]
        cmd = [
            sys.executable,
            "-m",
            "moe_core.cli",
            "train",
            "--out",
            str(run),
            "--preset",
            args.preset,
            "--nproc",
            str(n),
            *[a for item in sets for a in ("--set", item)],
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"ep{n} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        rows = [r for r in read_jsonl(run / "metrics.jsonl") if "step_time_s" in r][args.warmup :]
        step_s = statistics.median(r["step_time_s"] for r in rows)
        row = {"step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s}
        for key in (
            "comm/a2a_ms",
            "comm/a2a_ms_max",
            "comm/a2a_bytes_sent",
            "comm/frac_step",
            "comm/tokens_recv_imbalance",
        ):
            if key in rows[0]:
                row[key] = statistics.median(r[key] for r in rows)
        out[n] = row
    return out


def print_ep_scaling(args, scaling: dict[int, dict]) -> None:
    base = scaling[min(scaling)]["tokens_per_s"]
    print(
        f"EP scaling, {args.preset}: global batch {args.batch} x seq {args.seq}, {args.precision} on "
        f"{args.device}, {args.threads or 1} thread(s) per process, median of {args.rounds} steps"
    )
    print(
        f"{'procs':>5}{'step ms':>10}{'tokens/s':>11}{'speedup':>9}{'a2a ms':>9}{'a2a KiB/rank':>14}"
        f"{'comm frac':>11}{'imbalance':>11}"
    )
    for n, row in scaling.items():
        print(
            f"{n:>5}{row['step_s'] * 1e3:>10.1f}{row['tokens_per_s']:>11.0f}{row['tokens_per_s'] / base:>9.2f}"
            f"{row.get('comm/a2a_ms', 0):>9.1f}{row.get('comm/a2a_bytes_sent', 0) / 1024:>14.1f}"
            f"{row.get('comm/frac_step', 0):>11.2f}{row.get('comm/tokens_recv_imbalance', 1):>11.2f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "train_step_ep_scaling",
                "preset": args.preset,
                "batch": args.batch,
                "seq": args.seq,
                "precision": args.precision,
                "device": args.device,
                "threads_per_process": args.threads or 1,
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "results": {str(n): {k: round(v, 4) for k, v in row.items()} for n, row in scaling.items()},
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="switch-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quality-steps", type=int, default=300, help="0 skips the quality run")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also moe with compile=true, and compiled with expert_impl=static (every expert on every token)",
    )
    parser.add_argument(
        "--expert-impl",
        action="append",
        default=[],
        metavar="IMPL",
        help="also the MoE step with this expert_impl (sorted, grouped_mm, static, ...; repeatable)",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-documents", type=int, default=2000, help="of the built-in corpus")
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument(
        "--ep-scaling",
        type=lambda s: [int(n) for n in s.split(",")],
        default=None,
        metavar="1,2,4",
        help="only the EP scaling runs, with these process counts",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ep_scaling:
        with tempfile.TemporaryDirectory(prefix="moe-ep-bench-") as tmp:
            print_ep_scaling(args, ep_scaling(args, Path(tmp)))
        return

    with tempfile.TemporaryDirectory(prefix="moe-train-bench-") as tmp:
        speed = step_times(args, Path(tmp))
        qual = quality(args, Path(tmp)) if args.quality_steps > 0 else {}

    print(
        f"{args.preset}: batch {args.batch} x seq {args.seq}, {args.precision} on {args.device}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved steps"
    )
    print(
        f"{'variant':<20}{'step ms':>10}{'tokens/s':>12}{'x dense-active':>16}{'active M':>10}{'total M':>10}"
    )
    base = speed["dense-active"]["step_s"]
    for name, row in speed.items():
        print(
            f"{name:<20}{row['step_s'] * 1e3:>10.1f}{row['tokens_per_s']:>12.0f}{row['step_s'] / base:>16.2f}"
            f"{row['params_active'] / 1e6:>10.2f}{row['params_total'] / 1e6:>10.2f}"
        )
    if qual:
        print(f"\nquality after {qual['moe']['tokens']} tokens on the built-in corpus:")
        for name, row in qual.items():
            print(
                f"{name:<14} val loss {row['val_loss']:.4f}  val ppl {row['val_ppl']:.2f}  ({row['wall_s']:.0f} s)"
            )
    figures = {
        "benchmark": "train_step",
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "precision": args.precision,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "step_ms": {k: round(v["step_s"] * 1e3, 2) for k, v in speed.items()},
        "tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in speed.items()},
        "moe_over_dense_active": round(speed["moe"]["step_s"] / base, 3),
        "moe_over_dense_total": round(speed["moe"]["step_s"] / speed["dense-total"]["step_s"], 3),
    }
    if qual:
        figures.update(
            {
                "quality_tokens": qual["moe"]["tokens"],
                "val_ppl": {k: round(v["val_ppl"], 3) for k, v in qual.items()},
                "val_ppl_moe_over_dense_active": round(
                    qual["moe"]["val_ppl"] / qual["dense-active"]["val_ppl"], 4
                ),
            }
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
