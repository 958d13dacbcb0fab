"""Forward+backward throughput of one MoE layer against its floor, the dense FFN of equal active size.

Runs, in one process and interleaved round by round (so machine noise hits all alike):
  ours-<impl>  our MoEBlock (router + experts) with each expert implementation
  hf-mixtral   transformers' MixtralSparseMoeBlock holding the same weights
  dense-active a SwiGLU FFN of width K*F: the same active parameters, no routing

Prints tokens/s and time ratios against dense-active, then one JSON line.

    python benchmarks/moe_layer.py                       # batch 8, seq 256, hidden 512, 8 experts, top-2
    python benchmarks/moe_layer.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from moe_core.config import get_config
from moe_core.model import FeedForward, MoEBlock


def build(args):
    config = get_config(
        "mixtral-tiny",
        hidden_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        expert_intermediate_size=args.ffn,
        router_aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
    )
    torch.manual_seed(0)
    ours = MoEBlock(config)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.02)

    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=args.hidden,
            intermediate_size=args.ffn,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
    )
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.gate.weight)
        # transformers 5 holds the experts fused: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
        hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.gate_proj, ours.experts.up_proj], dim=1))
        hf.experts.down_proj.copy_(ours.experts.down_proj)
    dense = FeedForward(args.hidden, args.top_k * args.ffn, "swiglu")
    return ours, hf, dense


def measure(args) -> dict:
    """Median forward+backward time of every variant, interleaved round by round; the JSON line's figures."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ours, hf, dense = (m.to(device=device, dtype=dtype) for m in build(args))
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)

    def x_in():
        return x.detach().requires_grad_(True)

    runs = {f"ours-{impl}": (lambda impl=impl: ours(x_in(), impl)[0]) for impl in args.impls.split(",")}
    runs["hf-mixtral"] = lambda: hf(x_in())  # (transformers 5 returns the hidden states alone)
    runs["dense-active"] = lambda: dense(x_in())

    def step(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn().backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in runs}
    peak_mb: dict[str, float] = {}
    for r in range(args.warmup + args.rounds):
        for name, fn in runs.items():
            for module in (ours, hf, dense):
                module.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = step(fn)
            if device.type == "cuda":
                peak_mb[name] = torch.cuda.max_memory_allocated(device) / 2**20
            if r >= args.warmup:
                times[name].append(t)

    tokens = args.batch * args.seq
    median = {name: statistics.median(ts) for name, ts in times.items()}
    floor = median["dense-active"]
    return {
        "benchmark": "moe_layer",
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "dtype": args.dtype,
        "tokens": tokens,
        "shape": {"D": args.hidden, "F": args.ffn, "E": args.experts, "K": args.top_k},
        "ms": {name: round(t * 1e3, 3) for name, t in median.items()},
        "tokens_per_s": {name: round(tokens / t, 1) for name, t in median.items()},
        "ratio_vs_dense_active": {name: round(t / floor, 4) for name, t in median.items()},
        "ours_vs_hf": round(median[f"ours-{args.impls.split(',')[0]}"] / median["hf-mixtral"], 4),
        "peak_mb": {name: round(mb, 1) for name, mb in peak_mb.items()},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024, help="expert width F; dense-active width is K*F")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impls", default="sorted,grouped_mm,reference")
    return p


def main() -> None:
    args = parser().parse_args()
    result = measure(args)
    print(
        f"device={result['device']} dtype={args.dtype} threads={torch.get_num_threads()} tokens={result['tokens']} "
        f"hidden={args.hidden} F={args.ffn} E={args.experts} K={args.top_k}"
    )
    print(f"{'layer':<20}{'fwd+bwd ms':>12}{'tokens/s':>12}{'x dense-active':>16}")
    for name, ms in result["ms"].items():
        print(
            f"{name:<20}{ms:>12.2f}{result['tokens_per_s'][name]:>12.0f}{result['ratio_vs_dense_active'][name]:>16.3f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
