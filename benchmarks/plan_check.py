"""The planner's predicted per-rank peak (`moe_core.train.plan`) against the real trainer's, on CPU with gloo.

    python benchmarks/plan_check.py                     # the seven layouts below, mixtral-small, ~2.5 GiB in all
    python benchmarks/plan_check.py --only 2 --steps 3
    python benchmarks/plan_check.py --device cuda --only 0 1 --precision bf16   # one GPU: CUDA's peak counters

Each configuration runs `moe_core.train.loop.Trainer` under torchrun (1, 2 or 4 processes; ep / DDP / FSDP2;
activation checkpointing off and on) for ``--steps`` optimizer steps on synthetic tokens (the AdamW state exists
from the first step on, so the second step is the steady one), and each rank measures its own peak:

    measured = peak resident set during the steps (VmHWM, reset through /proc/self/clear_refs right before the
               trainer is built: `telemetry.reset_peak_memory`) - resident set at that moment

with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) in the workers: every tensor above it
gets its own mapping and gives it back when freed, so the resident set follows the live tensors instead of the
heap's high-water mark (the dynamic threshold would keep freed 32 MiB blocks in the heap). Modules the trainer
imports lazily (DDP, FSDP2, the checkpoint code) are imported before the baseline. What remains beside the
tensors (Python objects of the model, gloo's buffers, autograd's graph nodes) is a few MiB and is in the ratio.
The predicted peak is the planner's for rank 0 (its FSDP2 shards are the widest); measured is the largest rank's.

With ``--device cuda`` each rank runs on its own GPU (NCCL) and measures with CUDA's counters instead: the peak of
allocated bytes (``torch.cuda.max_memory_allocated``, reset right before the trainer is built) less the bytes
allocated at that moment; the caching allocator's reserved peak is reported beside it. The process's host-side
bytes are not on the device, so the planner is asked for a CUDA rank and the overhead run is skipped. A layout
needs as many GPUs as processes.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, processes, ep_size, dp_mode, activation checkpointing)
LAYOUTS = [
    ("1 proc", 1, 1, "ddp", False),
    ("1 proc ckpt", 1, 1, "ddp", True),
    ("2 proc ep2 ddp", 2, 2, "ddp", False),
    ("2 proc fsdp2", 2, 1, "fsdp2", False),
    ("2 proc ep2 fsdp2 ckpt", 2, 2, "fsdp2", True),
    ("4 proc ep4 ddp", 4, 4, "ddp", False),
    ("4 proc ep2 fsdp2 ckpt", 4, 2, "fsdp2", True),
]


def train_config(args, ep: int, mode: str, ckpt: bool):
    from moe_core.train.config import TrainConfig

    return TrainConfig.build(
        {
            "model": {"preset": args.preset},
            "data": {"source": "synthetic", "seq_len": args.seq_len, "synthetic_blocks": 64},
            "parallel": {
                "ep_size": ep,
                "dp_mode": mode,
                "backend": "nccl" if args.device == "cuda" else "gloo",
            },
            "checkpoint": {"every": 10_000, "export": False},
            "log": {"every": 10_000, "progress": "off"},
            "eval": {"every": 0, "batches": 1},
            "batch_size": args.batch_size,
            "steps": args.steps,
            "device": args.device,
            "precision": args.precision,
            "activation_checkpointing": ckpt,
        }
    )


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def worker(args) -> None:
    """One rank: baseline, build the trainer, ``--steps`` steps, report its peak growth to ``--result``."""
    import torch
    import torch.distributed.checkpoint  # noqa: F401  (imported lazily by the trainer: not in the peak)
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    from moe_core.train import telemetry
    from moe_core.train.loop import Trainer

    torch.set_num_threads(1)
    config = train_config(args, args.ep, args.mode, args.ckpt)
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        device = torch.device("cpu")
        baseline = resident_bytes()
        telemetry.reset_peak_memory(device)
    trainer = Trainer(config, Path(args.out))
    try:
        for _ in range(args.steps):
            trainer.train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        else:
            peak = reserved = int(telemetry.max_memory_mb(device) * 2**20)
    finally:
        trainer.close()
    report = {"growth": peak - baseline, "reserved": reserved - baseline}
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(report))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args, preset: str, seq_len: int, nproc: int, ep: int, mode: str, ckpt: bool, result: Path
) -> list[int]:
    """Run one layout under torchrun; each rank's peak growth, bytes."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        __file__, "--worker", "--result", str(result), "--out", str(result.with_name(result.name + "_run")),
        "--ep", str(ep), "--mode", mode, "--preset", preset, "--seq-len", str(seq_len),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--device", args.device, "--precision", args.precision,
    ] + (["--ckpt"] if ckpt else [])  # fmt: skip
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"layout failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(nproc)]


def predicted_peak(args, preset: str, seq_len: int, nproc: int, ep: int, mode: str, ckpt: bool):
    from moe_core.train import plan

    config = train_config(
        argparse.Namespace(**{**vars(args), "preset": preset, "seq_len": seq_len}), ep, mode, ckpt
    )
    return plan.evaluate_layout(
        config, plan.model_params(config.model.build_config()), nproc, ep, mode, ckpt, device=args.device
    )


def run_layout(args, name: str, nproc: int, ep: int, mode: str, ckpt: bool, tmp: Path) -> dict:
    """The layout at ``--preset``, and again at ``--overhead-preset`` (a model of a few hundred KiB): that run's
    growth less its own prediction is what the process holds beside the tensors (Python objects, threads,
    gloo's buffers, code loaded on first use), the same for both; ``ratio_net`` compares the tensors alone."""
    stem = tmp / name.replace(" ", "_")
    predicted = predicted_peak(args, args.preset, args.seq_len, nproc, ep, mode, ckpt)
    ranks = launch(args, args.preset, args.seq_len, nproc, ep, mode, ckpt, stem)
    growth = [r["growth"] for r in ranks]
    overhead = 0
    if args.device == "cpu":  # on a GPU the process's own bytes are on the host, not in CUDA's counters
        small = predicted_peak(args, args.overhead_preset, 16, nproc, ep, mode, ckpt)
        small_growth = launch(
            args, args.overhead_preset, 16, nproc, ep, mode, ckpt, stem.with_name(stem.name + "_o")
        )
        overhead = max(0, max(r["growth"] for r in small_growth) - small.peak)
    measured = max(growth)
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {
        "layout": name,
        "predicted_mib": mib(predicted.peak),
        "measured_mib": mib(measured),
        "ratio": round(predicted.peak / measured, 3),
        "overhead_mib": mib(overhead),
        "ratio_net": round(predicted.peak / max(measured - overhead, 1), 3),
        "per_rank_mib": [mib(g) for g in growth],
        "reserved_mib": mib(max(r["reserved"] for r in ranks)),
        "weights_mib": mib(predicted.weights),
        "activations_mib": mib(predicted.activations),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mixtral-small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--overhead-preset", default="mixtral-tiny", help="the near-empty run that measures overhead"
    )
    p.add_argument("--only", type=int, nargs="*", help="indices into the layout list")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per process")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    layouts = [LAYOUTS[i] for i in args.only] if args.only else LAYOUTS
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        skipped = [layout[0] for layout in layouts if layout[1] > gpus]
        if skipped:
            print(f"skipped (more processes than the {gpus} GPU(s) here): {', '.join(skipped)}", flush=True)
        layouts = [layout for layout in layouts if layout[1] <= gpus]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f"{'layout':<24} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6} {'overhead MiB':>13} "
            f"{'ratio net':>9}  per rank",
            flush=True,
        )
        for layout in layouts:
            row = run_layout(args, *layout, Path(tmp))
            rows.append(row)
            print(
                f"{row['layout']:<24} {row['predicted_mib']:>14} {row['measured_mib']:>13} {row['ratio']:>6} "
                f"{row['overhead_mib']:>13} {row['ratio_net']:>9}  {row['per_rank_mib']}",
                flush=True,
            )
    worst = max((abs(r["ratio"] - 1) for r in rows), default=None)
    worst_net = max((abs(r["ratio_net"] - 1) for r in rows), default=None)
    print(json.dumps({"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size,
                      "device": args.device, "precision": args.precision,
                      "rows": rows, "worst_error": worst and round(worst, 3), "worst_error_net": worst_net and round(worst_net, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
