"""Training step time of an MoE model against its dense baselines, and a short quality run.

1. Step time: full optimizer steps (forward, backward, clip, AdamW, router bias update) of
   ``moe`` (the preset), ``dense-active`` (a dense FFN as wide as the K active experts) and ``dense-total``
   (as wide as all E experts), interleaved round by round so machine noise hits all alike; synthetic tokens.
   Target on CPU: moe step time <= 1.2x dense-active (the charter's < 20% overhead).
2. Quality: ``moe`` and ``dense-active`` trained on the built-in corpus for the same tokens, then validation
   loss and perplexity side by side (Switch Transformer, Fedus et al. 2021: MoE lower at equal active
   compute and tokens).

Prints a table, then ONE JSON line of the figures.

    python benchmarks/train_step.py                                  # switch-small, batch 8 x seq 128
    python benchmarks/train_step.py --preset mixtral-small --quality-steps 0   # step time only
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe_core.config import parameter_counts
from moe_core.train import TrainConfig
from moe_core.train.loop import Trainer


def config_for(args, baseline: str | None, steps: int, source: str) -> TrainConfig:
    return TrainConfig.build({
        "model": {"preset": args.preset, "baseline": baseline},
        "data": {"source": source, "seq_len": args.seq, "max_documents": args.max_documents,
                 "synthetic_blocks": max(64, args.batch * 4)},
        "steps": steps, "batch_size": args.batch, "precision": args.precision, "device": args.device,
        "optim": {"lr": args.lr, "warmup_steps": max(1, steps // 10)},
        "eval": {"every": 0, "batches": args.eval_batches},
        "log": {"every": max(1, steps // 5), "progress": "off"},
        "checkpoint": {"every": 10**9, "export": False},
    })


def step_times(args, workdir: Path) -> dict[str, dict]:
    variants = {"moe": None, "dense-active": "active", "dense-total": "total"}
    trainers = {name: Trainer(config_for(args, b, 10**6, "synthetic"), workdir / f"speed-{name}")
                for name, b in variants.items()}
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
        out[name] = {"step_s": median, "tokens_per_s": args.batch * args.seq / median,
                     "params_total": counts["total"], "params_active": counts["active"]}
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
        out[name] = {"val_loss": result.val_loss, "val_ppl": math.exp(result.val_loss),
                     "train_loss": result.loss, "tokens": result.tokens, "wall_s": time.perf_counter() - t0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="switch-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quality-steps", type=int, default=300, help="0 skips the quality run")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-documents", type=int, default=2000, help="of the built-in corpus")
    parser.add_argument("--eval-batches", type=int, default=32)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="moe-train-bench-") as tmp:
        speed = step_times(args, Path(tmp))
        qual = quality(args, Path(tmp)) if args.quality_steps > 0 else {}

    print(f"{args.preset}: batch {args.batch} x seq {args.seq}, {args.precision} on {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved steps")
    print(f"{'variant':<14}{'step ms':>10}{'tokens/s':>12}{'x dense-active':>16}{'active M':>10}{'total M':>10}")
    base = speed["dense-active"]["step_s"]
    for name, row in speed.items():
        print(f"{name:<14}{row['step_s'] * 1e3:>10.1f}{row['tokens_per_s']:>12.0f}{row['step_s'] / base:>16.2f}"
              f"{row['params_active'] / 1e6:>10.2f}{row['params_total'] / 1e6:>10.2f}")
    if qual:
        print(f"\nquality after {qual['moe']['tokens']} tokens on the built-in corpus:")
        for name, row in qual.items():
            print(f"{name:<14} val loss {row['val_loss']:.4f}  val ppl {row['val_ppl']:.2f}  ({row['wall_s']:.0f} s)")
    figures = {
        "benchmark": "train_step", "preset": args.preset, "batch": args.batch, "seq": args.seq,
        "precision": args.precision, "device": args.device, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(),
        "step_ms": {k: round(v["step_s"] * 1e3, 2) for k, v in speed.items()},
        "tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in speed.items()},
        "moe_over_dense_active": round(speed["moe"]["step_s"] / base, 3),
        "moe_over_dense_total": round(speed["moe"]["step_s"] / speed["dense-total"]["step_s"], 3),
    }
    if qual:
        figures.update({
            "quality_tokens": qual["moe"]["tokens"],
            "val_ppl": {k: round(v["val_ppl"], 3) for k, v in qual.items()},
            "val_ppl_moe_over_dense_active": round(qual["moe"]["val_ppl"] / qual["dense-active"]["val_ppl"], 4),
        })
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
