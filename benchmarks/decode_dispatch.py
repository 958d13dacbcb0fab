"""What dispatching a compiled static-cache decode step costs: the same graphs called three ways.

  guarded    dynamo's frame evaluation and guard checks on every call     (compile_steps' default)
  bytecode   the bytecode dynamo produced, called directly: it fetches every graph input from the modules
             and calls the graph through AOT autograd's runtime wrapper    (direct_dispatch=True, graph_call=False)
  graph      inductor's compiled graph on a prebuilt input list             (direct_dispatch=True)

for the MoE, dense-total and dense-active (the models of benchmarks/inference.py, untrained: only speed is
measured), interleaved round by round in one process so the host's noise hits every variant alike. Prints
each model's median ms per step, each variant's fraction of the memory-bound ratio bound (dense-total time
over MoE time, over dense-total bytes / MoE bytes), then ONE JSON line of figures.

    python benchmarks/decode_dispatch.py                         # olmoe-small, batch 1, 15 rounds
    python benchmarks/decode_dispatch.py --preset olmoe-base --rounds 5 --steps 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from inference import compiled_runner, decode_bytes  # benchmarks/inference.py (this directory is on sys.path)

from moe_core import MoEForCausalLM, dense_baseline, get_config
from moe_core.inference.compile import compile_steps
from moe_core.inference.fast_decode import enable_fast_decode

VARIANTS = {
    "guarded": {},  # compile_steps' default
    "bytecode": dict(direct_dispatch=True, graph_call=False),
    "graph": dict(direct_dispatch=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="olmoe-small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = get_config(args.preset)
    bound = decode_bytes(dense_baseline(config, "total")) / decode_bytes(config)
    torch.manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len))

    runners = {}
    for model_name in ("moe", "dense-total", "dense-active"):
        c = config if model_name == "moe" else dense_baseline(config, model_name.removeprefix("dense-"))
        torch.manual_seed(0)
        model = enable_fast_decode(MoEForCausalLM(c).eval())
        for variant, options in VARIANTS.items():
            steps = compile_steps(
                model,
                cache="static",
                max_cache_len=args.prompt_len + args.steps + 1,
                compile_prefill=False,
                **options,
            )
            for _ in range(3):  # compile, record, warm
                compiled_runner(steps, prompt, 3)()
            runners[model_name, variant] = compiled_runner(steps, prompt, args.steps)
    times = {key: [] for key in runners}
    for _ in range(args.rounds):
        for key, run in runners.items():
            times[key].append(1e3 * run()[1])  # ms per decode step
    median = {key: statistics.median(v) for key, v in times.items()}

    print(
        f"{args.preset}: {platform.machine()}, {args.threads} thread(s), batch {args.batch}, "
        f"{args.steps} decode steps x {args.rounds} rounds (medians); bound {bound:.2f}x"
    )
    print(f"{'variant':<10}{'moe ms':>9}{'dense-total ms':>16}{'dense-active ms':>17}{'of the bound':>14}")
    figures = {"preset": args.preset, "batch": args.batch, "rounds": args.rounds, "bound": round(bound, 3)}
    for variant in VARIANTS:
        moe, total, active = (median[m, variant] for m in ("moe", "dense-total", "dense-active"))
        fraction = total / moe / bound
        print(f"{variant:<10}{moe:>9.3f}{total:>16.3f}{active:>17.3f}{100 * fraction:>13.1f}%")
        figures[variant] = {
            "moe_ms": round(moe, 4),
            "dense_total_ms": round(total, 4),
            "dense_active_ms": round(active, 4),
            "fraction_of_bound": round(fraction, 3),
        }
    # the MoE's saving per step, paired round by round
    for a, b in (("guarded", "bytecode"), ("bytecode", "graph")):
        saved = statistics.median(x - y for x, y in zip(times["moe", a], times["moe", b]))
        print(f"moe {a} -> {b}: {1e3 * saved:.0f} us a step saved (paired median)")
        figures[f"moe_saved_us_{a}_to_{b}"] = round(1e3 * saved, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
