"""The optimizer step of a LoRA fine-tune on stacked experts: what ``optim.idle_experts=hold`` (`ExpertAdamW`)
costs against ``=step`` (torch's fused AdamW over the same parameters), in host time and operators a step.

A GPU fine-tuning step is bound by its host: the device waits while Python dispatches the next operators, so
every operator the optimizer adds is time (on the H100 the per-expert path made the full OLMoE-1B-7B LoRA step
0.298 s against 0.160 s with ``=step``). This measures the update alone, on a model with the published counts
(layers, experts, top-k) at tiny widths, so nothing but dispatching is timed, with real gradients from one
forward and backward (experts without tokens have exactly zero gradients):

- ``adamw-fused``: torch's AdamW, fused (what a fine-tune with ``idle_experts=step`` steps by);
- ``adamw-foreach``: torch's AdamW, multi-tensor;
- ``per-expert``: `ExpertAdamW`'s CPU path (each expert a view stepped by torch's functional AdamW; one read of
  the experts that took tokens back to the host);
- ``masked``: `ExpertAdamW`'s accelerator path (every stack as one tensor, per-expert coefficients, no read back).

Each variant steps ``--warmup`` times, then ``--steps`` timed steps; host time is until the last step returns,
wall time until the device is done too. Operators: the aten calls torch.profiler sees in one step.

    python benchmarks/expert_adamw.py                       # OLMoE-1B-7B counts, CPU
    python benchmarks/expert_adamw.py --device cuda         # on a GPU (the figure that matters)
    python benchmarks/expert_adamw.py --published-widths --batch 1 --seq 64 --steps 5   # full size, CPU

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_scale import COUNT_FIELDS, LORA_R, LR  # noqa: E402  (one definition of the benchmark's LoRA)

from moe_core import load  # noqa: E402
from moe_core.finetune import FinetuneConfig  # noqa: E402
from moe_core.finetune.methods import apply_method, expert_axes  # noqa: E402
from moe_core.published import PUBLISHED, build_published  # noqa: E402
from moe_core.train.optim import ExpertAdamW  # noqa: E402

VARIANTS = ("adamw-fused", "adamw-foreach", "per-expert", "masked")


def narrow_model(args):
    """The published config of ``args.model`` at its tiny widths with every count kept (written to the cache as
    `finetune_scale.py --narrow` writes it), LoRA on attention and every expert, after one forward and
    backward on random tokens: the gradients every variant steps with."""
    published = PUBLISHED[args.model]
    overrides = {k: v for k, v in published.tiny_overrides.items() if k not in COUNT_FIELDS}
    checkpoint = build_published(
        args.model,
        layers=args.layers,
        overrides=None if args.published_widths else overrides,
        cache_dir=args.cache_dir,
        seed=args.seed,
    )
    torch.manual_seed(args.seed)
    # at published widths the base stays memory-mapped, as a fine-tune holds it
    model = load(checkpoint, memory_map=args.published_widths).model.to(args.device)
    config = FinetuneConfig.build({"lora": {"r": LORA_R, "experts": "all"}, "optim": {"lr": LR}})
    model, _ = apply_method(model, config)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
    model(input_ids=ids, labels=ids).loss.backward()
    return model


def optimizer_for(variant: str, model, lr: float):
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=lr, weight_decay=0.01)
    if variant == "adamw-fused":
        return torch.optim.AdamW(params, fused=True, **kwargs)
    if variant == "adamw-foreach":
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    masked = variant == "masked"
    return ExpertAdamW(params, expert_axes=expert_axes(model), masked=masked, fused=True, **kwargs)


def measure(variant: str, model, warmup: int, steps: int, device: str) -> dict:
    optimizer = optimizer_for(variant, model, LR)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        optimizer.step()
    sync()
    host, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        host.append(time.perf_counter() - start)
        sync()
        wall.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step()
        sync()
    operators = sum(1 for event in prof.events() if event.name.startswith("aten::"))
    state_elements = sum(t.numel() for s in optimizer.state.values() for t in _tensors(s))
    return {
        "host_ms": 1e3 * statistics.median(host),
        "wall_ms": 1e3 * statistics.median(wall),
        "aten_calls": operators,
        "state_elements": state_elements,
    }


def _tensors(state):
    for value in state.values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            yield from _tensors(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="olmoe-1b-7b", help="a published model (moe_core.published)")
    parser.add_argument("--layers", type=int, default=None, help="cut to the first N decoder layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--published-widths",
        action="store_true",
        help="the published model itself (its widths too), memory-mapped: the update's passes over memory count",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", choices=VARIANTS, default=[])
    parser.add_argument("--cache-dir", default=None, help="default: $MOE_LAB_PUBLISHED_CACHE or ~/.cache/...")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = narrow_model(args)
    axes = expert_axes(model)
    results = {}
    for variant in args.only or VARIANTS:
        # every variant from the same parameters: the updates move them
        saved = {p: p.detach().clone() for p in model.parameters() if p.requires_grad}
        results[variant] = measure(variant, model, args.warmup, args.steps, args.device)
        with torch.no_grad():
            for p, value in saved.items():
                p.copy_(value)
    base = results.get("adamw-fused")
    print(
        f"{args.model}: {model.config.num_hidden_layers} layers, {len(axes)} stacked LoRA factors, "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f} M trainable; "
        f"median of {args.steps} steps after {args.warmup}, on {args.device}"
    )
    print(f"{'variant':16} {'host ms':>8} {'wall ms':>8} {'x fused':>8} {'aten calls':>11} {'state M':>8}")
    for variant, r in results.items():
        ratio = r["wall_ms"] / base["wall_ms"] if base else float("nan")
        r["wall_over_fused"] = round(ratio, 3)
        print(
            f"{variant:16} {r['host_ms']:8.2f} {r['wall_ms']:8.2f} {ratio:8.2f} {r['aten_calls']:11d} "
            f"{r['state_elements'] / 1e6:8.2f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "expert_adamw",
                "model": args.model,
                "layers": model.config.num_hidden_layers,
                "stacked_factors": len(axes),
                "device": args.device,
                "machine": {"cpu": platform.machine(), "torch": torch.__version__},
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
