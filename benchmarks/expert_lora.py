"""LoRA on one MoE layer's experts at a published size: forward + backward time and what autograd keeps.

Runs, in one process and interleaved round by round (so machine noise hits all alike), one MoE layer (router +
experts, frozen) with LoRA rank r on every expert's gate/up/down projection, on the same tokens:
  routed       our experts with the lab's expert LoRA (`moe_core.finetune.expert_lora`): the update applied on
               the tokens routed to each expert, (x A_e^T) B_e^T
  peft-stack   our experts with PEFT's own ``target_parameters`` forward (``ParamWrapper``: W + s B A formed for
               the whole [E, O, I] stack at every forward)
  hf-peft      transformers' own sparse MoE block of that architecture (5.x: the experts fused into
               gate_up_proj and down_proj, a loop over the experts hit) with stock PEFT LoRA on them
               (``target_parameters``): what a user of transformers + PEFT runs (the 4.57 per-expert Linear
               figures in benchmarks/README.md were taken before the move)
Prints the median step time, tokens/s and the bytes autograd keeps for backward (outside the weights), then the
ratios against hf-peft and one JSON line.

    python benchmarks/expert_lora.py                    # OLMoE-1B-7B's layer: 64 experts top-8, 2048 -> 1024
    python benchmarks/expert_lora.py --tokens 512 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from peft import LoraConfig, inject_adapter_in_model

from moe_core.config import get_config
from moe_core.finetune import expert_lora
from moe_core.model import MoEBlock


def build(args):
    dtype = getattr(torch, args.dtype)
    config = get_config(
        "mixtral-tiny",
        hidden_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        expert_intermediate_size=args.ffn,
        norm_topk_prob=False,  # OLMoE
        router_aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
    )
    torch.manual_seed(0)
    weights = MoEBlock(config)
    for p in weights.parameters():
        torch.nn.init.normal_(p, std=0.02)
    weights = weights.to(dtype)
    targets = [f"experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]

    def ours(routed: bool):
        block = MoEBlock(config).to(dtype)
        block.load_state_dict(weights.state_dict())
        block.requires_grad_(False)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=[], target_parameters=targets)
        if routed:
            expert_lora.register(lora)
        return inject_adapter_in_model(lora, block)

    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    hf = OlmoeSparseMoeBlock(
        OlmoeConfig(
            hidden_size=args.hidden,
            intermediate_size=args.ffn,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            norm_topk_prob=False,
        )
    ).to(dtype)
    with torch.no_grad():
        hf.gate.weight.copy_(weights.router.gate.weight)
        # transformers 5 holds the experts fused: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F];
        # PEFT adapts them through target_parameters (one LoRA over gate and up together)
        hf.experts.gate_up_proj.copy_(torch.cat([weights.experts.gate_proj, weights.experts.up_proj], dim=1))
        hf.experts.down_proj.copy_(weights.experts.down_proj)
    hf.requires_grad_(False)
    hf = inject_adapter_in_model(
        LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=[],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        ),
        hf,
    )
    return {"routed": ours(True), "peft-stack": ours(False), "hf-peft": hf}


def step(module, x_BSD: torch.Tensor) -> None:
    out = module(x_BSD)
    y = out[0] if isinstance(out, tuple) else out
    y.float().square().mean().backward()


def saved_bytes(module, x_BSD: torch.Tensor) -> int:
    """Bytes of the storages autograd keeps for backward, other than the weights' own."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(module, x_BSD)
    return sum(kept.values())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    return p


def main() -> None:
    args = parser().parse_args()
    modules = build(args)
    torch.manual_seed(1)
    x_BSD = torch.randn(1, args.tokens, args.hidden, dtype=getattr(torch, args.dtype), requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in modules}
    for module in modules.values():  # warm-up
        step(module, x_BSD)
    for _ in range(args.rounds):
        for name, module in modules.items():
            start = time.perf_counter()
            step(module, x_BSD)
            times[name].append(time.perf_counter() - start)
    kept = {name: saved_bytes(module, x_BSD) for name, module in modules.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"one MoE layer, {args.experts} experts top-{args.top_k}, {args.hidden} -> {args.ffn}, LoRA r={args.rank}"
    )
    print(f"{args.tokens} tokens, {args.dtype}, forward + backward, median of {args.rounds}")
    print(f"{'':12} {'ms':>9} {'tokens/s':>10} {'kept MiB':>9} {'time/hf':>8} {'kept/hf':>8}")
    for name in modules:
        print(
            f"{name:12} {1e3 * median[name]:9.1f} {args.tokens / median[name]:10.0f} "
            f"{kept[name] / 2**20:9.1f} {median[name] / median['hf-peft']:8.2f} "
            f"{kept[name] / kept['hf-peft']:8.2f}"
        )
    result = {
        "benchmark": "expert_lora",
        "shape": {
            k: getattr(args, k) for k in ("hidden", "ffn", "experts", "top_k", "rank", "tokens", "dtype")
        },
        "ms": {k: round(1e3 * v, 2) for k, v in median.items()},
        "kept_mib": {k: round(v / 2**20, 2) for k, v in kept.items()},
        "routed_time_vs_hf_peft": round(median["routed"] / median["hf-peft"], 3),
        "routed_time_vs_peft_stack": round(median["routed"] / median["peft-stack"], 3),
        "routed_kept_vs_hf_peft": round(kept["routed"] / kept["hf-peft"], 3),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
