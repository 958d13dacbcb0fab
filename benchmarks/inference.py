"""Decode throughput and prefill latency of an MoE model against dense models, eager / compiled / ONNX.

Runs, in one process and interleaved round by round (so machine noise hits all alike), batch-1 greedy
decoding with a KV cache:
  moe-eager          our model with the decode path of moe_core.inference.fast_decode (K experts per token)
  moe-compiled       moe_core.inference.compile_steps: fullgraph prefill (static experts) and decode
                     (gathered experts, reduction GEMVs)                             (--compile)
  moe-onnx-fp32      torch.onnx (dynamo) export run in ONNX Runtime                    (--onnx)
  moe-onnx-int8      the same after ONNX Runtime's quantize_dynamic int8               (--onnx)
  dense-total        a dense model with as many FFN parameters as the MoE total
  dense-active       a dense model with as many FFN parameters as the MoE active
  dense-*-compiled   the dense models through the same compile_steps (same GEMV kernel) (--compile)
  *-compiled-static  the same compiled decode on a preallocated StaticCache, eager prefill;
                     also at batch 8 and 32 (--batches) for the MoE and dense-total      (--compile)
  cache-25/50/100    the MoE with experts on disk behind an LRU holding 25/50/100% of them
  moe-int4-rtn/gptq/awq  int4 experts (group 32) by round-to-nearest, GPTQ, AWQ, eager decode   (--quant)
Then (--prune) a size-against-perplexity sweep: the MoE pruned on calibration data to 100/75/50/25% of its
experts (and K), ranked by routed slots (frequency) or REAP saliency, each dropped expert discarded or merged
into its nearest kept one; for routers whose top-k weights are raw softmax probabilities (OLMoE), three ways:
the dropped experts' mass kept in the router's softmax denominator and a token's choice of one refilled by
its next-best kept expert (refill, the default) or left empty (drop, --pruned-choices drop of moe-lab prune),
or the softmax renormalized over the kept experts (renorm, --renormalize).

The memory-bound ratio bound of batch-1 decode is (bytes read per token by dense-total) / (by the MoE): all
weights but the input embedding, of which one row is read. The headline ratio is the fastest MoE run over
the fastest dense-total run (eager or compiled), so a kernel that helps both cannot inflate it. Perplexity drift of the ONNX int8 model is taken
on a model first trained briefly here (--train-steps) on a synthetic sparse Markov-chain corpus, so the
perplexity is far from uniform and drift is meaningful. Prints a table, then ONE JSON line of figures.

    python benchmarks/inference.py                              # olmoe-small (bound 4.6x), ONNX on
    python benchmarks/inference.py --preset mixtral-small --set hidden_size=512 expert_intermediate_size=1024
                                                                # the issue's Mixtral reference, bound 2.6x
    python benchmarks/inference.py --compile                    # add torch.compile (minutes to compile)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe_core import MoEForCausalLM, dense_baseline, get_config, parameter_counts
from moe_core.configfile import parse_value


def markov_corpus(
    vocab: int, sequences: int, seq: int, seed: int = 0, fanout: int = 4, active: int = 256
) -> torch.Tensor:
    """Token ids from a fixed random chain over `active` of the ids, each with `fanout` possible successors
    (small enough to be learned in a minute: the perplexity floor is `fanout`)."""
    g = torch.Generator().manual_seed(1234)  # the chain is fixed; `seed` draws the sequences
    active = min(active, vocab)
    successors = torch.randint(0, active, (active, fanout), generator=g)
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(sequences, seq, dtype=torch.long)
    out[:, 0] = torch.randint(0, active, (sequences,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, fanout, (sequences,), generator=g)
        out[:, t] = successors[out[:, t - 1], pick]
    return out


def train_briefly(model, steps: int, vocab: int, batch: int = 8, seq: int = 64) -> None:
    data = markov_corpus(vocab, steps * batch, seq, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for i in range(steps):
        x = data[i * batch : (i + 1) * batch]
        loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def decode_bytes(config) -> int:
    counts = parameter_counts(config)
    return 4 * (counts["active"] - config.vocab_size * config.hidden_size)


def prune_sweep(moe, calibration, valid) -> list[dict]:
    """Parameters and validation perplexity of the MoE pruned to fewer experts, ranked by routed slots
    (frequency) or by REAP saliency, each dropped expert discarded or merged."""
    from moe_core.inference.evaluate import perplexity
    from moe_core.inference.prune import PruneConfig, collect_saliency, collect_usage, prune_experts
    from moe_core.routing import pruned_mass_matters

    E, K = moe.config.num_experts, moe.config.num_experts_per_tok
    usage = collect_usage(moe, calibration)
    saliency = collect_saliency(moe, calibration)
    rows = []
    # how the pruned router treats the dropped experts (PruneConfig): their mass kept in the softmax and a
    # token's choice of one refilled or dropped, or renormalized; these differ only for raw softmax weights
    routers = {
        "refill": {},
        "drop": {"pruned_choices": "drop"},
        "renorm": {"renormalize": True},
    }
    if not pruned_mass_matters(moe.config):
        routers = {"refill": {}}
    for keep in sorted({E, 3 * E // 4, E // 2, E // 4, K} - {0}, reverse=True):
        for criterion in ("frequency", "reap") if keep < E else ("frequency",):
            for merge in (False, True) if keep < E else (False,):
                for router, options in routers.items() if keep < E else [("refill", {})]:
                    config = PruneConfig(
                        keep_experts=keep, merge_similar=merge, criterion=criterion, **options
                    )
                    pruned, report = prune_experts(moe, usage, config, saliency)
                    rows.append(
                        {
                            "experts": keep,
                            "criterion": criterion,
                            "merge": merge,
                            "router": router,
                            "params": report.params_after,
                            "size": round(report.params_after / report.params_before, 3),
                            "usage_kept": round(min(report.usage_share_kept.values()), 3),
                            "perplexity": round(perplexity(pruned, valid), 3),
                        }
                    )
    return rows


def quantized_models(moe, calibration, bits: int = 4, group_size: int = 32) -> dict[str, tuple]:
    """Copies of the MoE with int4 experts by RTN, GPTQ and AWQ (calibrated on the same batches)."""
    import copy

    from moe_core.inference.quantize import QuantConfig, quantize_experts

    out = {}
    for method in ("rtn", "gptq", "awq"):
        model = copy.deepcopy(moe).eval()
        t0 = time.perf_counter()
        report = quantize_experts(
            model,
            QuantConfig(bits=bits, group_size=group_size, method=method),
            calibration if method != "rtn" else None,
        )
        out[f"moe-int{bits}-{method}"] = (model, report, time.perf_counter() - t0)
    return out


def torch_runner(model, prompt, steps):
    def run():
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(prompt, use_cache=True, logits_to_keep=1)
            prefill = time.perf_counter() - t0
            cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(nxt, cache=cache, use_cache=True)
                cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
            return prefill, (time.perf_counter() - t0) / steps

    return run


def compiled_runner(steps_fns, prompt, steps):
    """Prefill seconds and seconds per decode step (each step decodes one token for every row of ``prompt``)."""

    @torch.no_grad()  # as generation runs
    def run():
        t0 = time.perf_counter()
        logits, cache = steps_fns.prefill(prompt)
        prefill = time.perf_counter() - t0
        nxt = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = steps_fns.decode(nxt, cache)
            nxt = logits.argmax(-1, keepdim=True)
        return prefill, (time.perf_counter() - t0) / steps

    return run


def ort_runner(ort_model, prompt, steps):
    def run():
        mask = torch.ones_like(prompt)
        t0 = time.perf_counter()
        out = ort_model(input_ids=prompt, attention_mask=mask, use_cache=True)
        prefill = time.perf_counter() - t0
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = ort_model(input_ids=nxt, attention_mask=mask, cache=out.cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        return prefill, (time.perf_counter() - t0) / steps

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="olmoe-small")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, e.g. hidden_size=512 expert_intermediate_size=1024",
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads")
    parser.add_argument("--train-steps", type=int, default=120, help="training before the perplexity checks")
    parser.add_argument("--onnx", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--cpp-wrapper",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the steps with inductor's C++ wrapper (compile_steps' default; --no-cpp-wrapper: Python)",
    )
    parser.add_argument(
        "--direct-dispatch",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the compiled static-cache decode without dynamo's per-call guard checks (opt-in, torch "
        "internals: moe_core.torch_seam; compile_steps' default is guarded)",
    )
    parser.add_argument(
        "--graph-call",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with direct dispatch, run the compiled graph on a prebuilt input list (the default there; "
        "--no-graph-call: dynamo's bytecode)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes of the batched compiled static-cache decode beside batch 1 (--compile; "
        "default, and --batches alone: 8 32; --batches 1: batch 1 only)",
    )
    parser.add_argument("--prune", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--quant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="int4 experts by RTN, GPTQ and AWQ: perplexity drift, size, eager decode speed",
    )
    args = parser.parse_args()
    args.batches = [b for b in (args.batches or [8, 32]) if b > 1]  # `--batches` alone once meant none
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from moe_core.inference.evaluate import drift, perplexity
    from moe_core.inference.fast_decode import disable_fast_decode, enable_fast_decode

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = parse_value(value)
    config = get_config(args.preset, **overrides)
    moe = MoEForCausalLM(config)
    t0 = time.perf_counter()
    train_briefly(moe, args.train_steps, config.vocab_size)
    train_s = time.perf_counter() - t0
    enable_fast_decode(moe)
    dense_total = MoEForCausalLM(dense_baseline(config, "total")).eval()
    dense_active = MoEForCausalLM(dense_baseline(config, "active")).eval()
    prompt = markov_corpus(config.vocab_size, 1, args.prompt_len, seed=7)
    valid = list(markov_corpus(config.vocab_size, 16, 64, seed=1).split(4))

    runners = {
        "moe-eager": torch_runner(moe, prompt, args.steps),
        "dense-total": torch_runner(dense_total, prompt, args.steps),
        "dense-active": torch_runner(dense_active, prompt, args.steps),
    }
    figures: dict = {
        "preset": args.preset,
        "overrides": overrides,
        "threads": args.threads,
        "train_steps": args.train_steps,
        "train_s": round(train_s, 1),
        "cpp_wrapper": args.cpp_wrapper,
        "direct_dispatch": args.direct_dispatch,
        "graph_call": args.graph_call,
    }
    workdir = Path(tempfile.mkdtemp(prefix="moe_inference_bench_"))
    ppl = {"moe-eager": perplexity(moe, valid)}
    batch_of: dict[str, int] = {}  # runs decoding more than one sequence a step
    try:
        if args.compile:
            from moe_core.inference.compile import compile_steps

            figures["compile_s"] = {}
            max_len = args.prompt_len + args.steps + 1
            for name, model in (("moe", moe), ("dense-total", dense_total), ("dense-active", dense_active)):
                compiled = compile_steps(model, cpp_wrapper=args.cpp_wrapper)
                t0 = time.perf_counter()
                compiled_runner(
                    compiled, prompt, 2
                )()  # compile prefill and decode (and the dynamic recompile)
                compiled_runner(compiled, prompt, 2)()
                figures["compile_s"][name] = round(time.perf_counter() - t0, 1)
                runners[f"{name}-compiled"] = compiled_runner(compiled, prompt, args.steps)
                # the static KV cache: eager prefill (as batch_generate), compiled decode, one cache per batch
                static = compile_steps(
                    model,
                    cache="static",
                    max_cache_len=max_len,
                    compile_prefill=False,
                    cpp_wrapper=args.cpp_wrapper,
                    direct_dispatch=args.direct_dispatch,
                    graph_call=args.graph_call,
                )
                t0 = time.perf_counter()
                for batch in [1] + ([] if name == "dense-active" else args.batches):
                    rows = markov_corpus(config.vocab_size, batch, args.prompt_len, seed=7)
                    compiled_runner(static, rows, 2)()
                    suffix = "" if batch == 1 else f"@b{batch}"
                    runners[f"{name}-compiled-static{suffix}"] = compiled_runner(static, rows, args.steps)
                    if batch > 1:
                        batch_of[f"{name}-compiled-static{suffix}"] = batch
                figures["compile_s"][f"{name}-static"] = round(time.perf_counter() - t0, 1)
        if args.onnx:
            import onnxruntime as ort

            from moe_core.inference.onnx_export import export_onnx, load_onnx
            from moe_core.inference.quantize import quantize_onnx_dynamic

            disable_fast_decode(moe)
            t0 = time.perf_counter()
            export_onnx(moe, workdir / "fp32", validate=False)
            quantize_onnx_dynamic(workdir / "fp32", workdir / "int8")
            figures["onnx_export_s"] = round(time.perf_counter() - t0, 1)
            enable_fast_decode(moe)
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            for name, sub in (("moe-onnx-fp32", "fp32"), ("moe-onnx-int8", "int8")):
                ort_model = load_onnx(workdir / sub, session_options=options)
                runners[name] = ort_runner(ort_model, prompt, args.steps)
                ppl[name] = perplexity(ort_model, valid)
        if args.quant:
            calibration = list(markov_corpus(config.vocab_size, 32, 64, seed=2).split(8))
            disable_fast_decode(moe)
            quantized = quantized_models(moe, calibration)
            enable_fast_decode(moe)
            fp32_bytes = sum(t.numel() * t.element_size() for t in moe.state_dict().values())
            figures["quant"] = {}
            for name, (model, report, seconds) in quantized.items():
                ppl[name] = perplexity(model, valid)
                runners[name] = torch_runner(model, prompt, args.steps)
                figures["quant"][name] = {
                    "bytes": report.bytes_after,
                    "size": round(report.bytes_after / fp32_bytes, 3),
                    "experts_quantized": report.experts_quantized,
                    "rtn_fallback": len(report.experts_rtn_fallback),
                    "quantize_s": round(seconds, 1),
                    "forced_tokens": sum(sum(v) for v in report.forced_tokens.values()),
                }
        if args.cache:
            from moe_core.inference.expert_cache import offload_experts

            total_experts = config.num_experts * len(config.moe_layer_ids)
            caches = {}
            for pct in (25, 50, 100):
                m = MoEForCausalLM(config).eval()
                m.load_state_dict(moe.state_dict())
                caches[pct] = offload_experts(
                    m, workdir / "experts", capacity=max(1, total_experts * pct // 100), write=pct == 25
                )
                runners[f"cache-{pct}"] = torch_runner(m, prompt, args.steps)

        prefill = {name: [] for name in runners}
        decode = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, run in runners.items():
                p, d = run()
                prefill[name].append(p)
                decode[name].append(d)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    tps = {name: batch_of.get(name, 1) / statistics.median(v) for name, v in decode.items()}
    prefill_ms = {name: 1e3 * statistics.median(v) for name, v in prefill.items()}
    bound = decode_bytes(dense_baseline(config, "total")) / decode_bytes(config)

    def best(prefix: str) -> str:
        return max(
            (
                n
                for n in tps
                if n in (prefix, f"{prefix}-compiled", f"{prefix}-compiled-static", f"{prefix}-eager")
            ),
            key=tps.get,
        )

    moe_best, total_best, active_best = best("moe"), best("dense-total"), best("dense-active")
    ratio_total = tps[moe_best] / tps[total_best]
    print(
        f"{args.preset}: {platform.processor() or platform.machine()}, {args.threads} thread(s), "
        f"batch 1, prompt {args.prompt_len}, {args.steps} decode steps x {args.rounds} rounds (medians)"
    )
    print(f"{'run':<30}{'decode tok/s':>14}{'ms/token':>10}{'prefill ms':>12}{'vs dense-total':>16}")
    for name in runners:
        if name in batch_of:
            continue
        print(
            f"{name:<30}{tps[name]:>14.1f}{1e3 / tps[name]:>10.2f}{prefill_ms[name]:>12.1f}"
            f"{tps[name] / tps[total_best]:>15.2f}x"
        )
    print(
        f"memory-bound ratio bound (dense-total bytes / MoE active bytes): {bound:.2f}x; "
        f"{moe_best} reaches {ratio_total:.2f}x {total_best} = {100 * ratio_total / bound:.0f}% of it"
    )
    # the same two runs paired round by round (adjacent in time, so a slow host minute hits both): the
    # spread says how far one run's headline can be trusted
    paired = [t / m / bound for t, m in zip(decode[total_best], decode[moe_best])]
    q1, q2, q3 = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 else paired * 3
    print(
        f"per round, paired: {100 * q2:.0f}% of the bound (quartiles {100 * q1:.0f}-{100 * q3:.0f}%, "
        f"{args.rounds} rounds)"
    )
    figures.update(
        {
            "bound": round(bound, 3),
            "moe_vs_dense_total": round(ratio_total, 3),
            "fraction_of_bound": round(ratio_total / bound, 3),
            "fraction_of_bound_per_round": [round(q, 3) for q in (q1, q2, q3)],  # quartiles
            "moe_run": moe_best,
            "dense_total_run": total_best,
            "moe_vs_dense_active": round(tps[moe_best] / tps[active_best], 3),
            "eager_moe_vs_dense_total": round(tps["moe-eager"] / tps["dense-total"], 3),
            "decode_tok_s": {k: round(v, 2) for k, v in tps.items()},
            "prefill_ms": {k: round(v, 2) for k, v in prefill_ms.items()},
            "perplexity": {k: round(v, 3) for k, v in ppl.items()},
        }
    )
    if args.compile:
        figures["compiled_moe_vs_dense_total"] = round(tps["moe-compiled"] / tps["dense-total-compiled"], 3)
        figures["static_moe_vs_dense_total"] = round(
            tps["moe-compiled-static"] / tps["dense-total-compiled-static"], 3
        )
        figures["static_fraction_of_bound"] = round(figures["static_moe_vs_dense_total"] / bound, 3)
        figures["batched"] = {}
        print(
            f"{'batch':>6}{'moe tok/s':>12}{'dense-total tok/s':>19}{'moe / dense-total':>19}   (compiled, static cache)"
        )
        for batch in [1] + args.batches:
            suffix = "" if batch == 1 else f"@b{batch}"
            moe_tps, dense_tps = (
                tps[f"moe-compiled-static{suffix}"],
                tps[f"dense-total-compiled-static{suffix}"],
            )
            figures["batched"][batch] = {
                "moe_tok_s": round(moe_tps, 1),
                "dense_total_tok_s": round(dense_tps, 1),
                "ratio": round(moe_tps / dense_tps, 3),
            }
            print(f"{batch:>6}{moe_tps:>12.1f}{dense_tps:>19.1f}{moe_tps / dense_tps:>18.2f}x")
    if args.onnx:
        figures["onnx_int8_vs_fp32"] = round(tps["moe-onnx-int8"] / tps["moe-onnx-fp32"], 3)
        figures["onnx_int8_ppl_drift"] = round(drift(ppl["moe-onnx-int8"], ppl["moe-onnx-fp32"]), 4)
        print(
            f"ONNX int8 / fp32 decode: {figures['onnx_int8_vs_fp32']:.2f}x; perplexity "
            f"{ppl['moe-onnx-fp32']:.2f} -> {ppl['moe-onnx-int8']:.2f} ({100 * figures['onnx_int8_ppl_drift']:+.2f}%)"
        )
    if args.quant:
        print(
            f"{'int4 experts':<18}{'perplexity':>12}{'drift vs fp32':>15}{'size':>7}{'decode tok/s':>14}"
            f"{'rtn fallbacks':>15}"
        )
        for name, row in figures["quant"].items():
            row["perplexity_drift"] = round(drift(ppl[name], ppl["moe-eager"]), 4)
            print(
                f"{name:<18}{ppl[name]:>12.3f}{100 * row['perplexity_drift']:>14.2f}%{row['size']:>7.2f}"
                f"{tps[name]:>14.1f}{row['rtn_fallback']:>15}"
            )
    if args.prune:
        disable_fast_decode(moe)
        figures["prune"] = prune_sweep(
            moe, list(markov_corpus(config.vocab_size, 32, 64, seed=2).split(8)), valid
        )
        print(
            f"{'experts':>8}{'criterion':>11}{'merged':>8}{'router':>8}{'params':>12}{'size':>7}"
            f"{'min usage kept':>16}{'perplexity':>12}{'drift':>9}"
        )
        for row in figures["prune"]:
            row["drift"] = round(drift(row["perplexity"], ppl["moe-eager"]), 4)
            print(
                f"{row['experts']:>8}{row['criterion']:>11}{'yes' if row['merge'] else 'no':>8}"
                f"{row['router']:>8}{row['params']:>12,}{row['size']:>7.2f}"
                f"{row['usage_kept']:>16.3f}{row['perplexity']:>12.2f}{100 * row['drift']:>8.2f}%"
            )
    if args.cache:
        figures["cache_hit_rate"] = {pct: round(c.stats.hit_rate, 3) for pct, c in caches.items()}
        print(
            "expert cache hit rate: "
            + ", ".join(f"{p}%: {r:.2f}" for p, r in figures["cache_hit_rate"].items())
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
