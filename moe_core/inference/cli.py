"""`moe-lab export onnx`, `moe-lab quantize`, `moe-lab prune`, `moe-lab generate`.

Heavy imports happen inside the handlers so ``moe-lab --help`` stays fast."""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import json
import sys

from moe_core.cli import add_router_module_option
from moe_core.paths import existing_path

# every command here stages its output beside --out and renames it into place when complete (moe_core.fileio)
OVERWRITE_HELP = "replace a non-empty output directory (only once the new output is complete)"


def _export_onnx(args: argparse.Namespace) -> int:
    from moe_core.inference.onnx_export import export_onnx

    out = export_onnx(
        args.model_dir, args.out, opset=args.opset, validate=not args.no_validate, overwrite=args.overwrite
    )
    print(f"wrote {out}")
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    from moe_core.inference.gguf_export import export_gguf

    print(f"wrote {export_gguf(args.hf_dir, args.out, overwrite=args.overwrite, mla=args.mla)}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from moe_core.inference.quantize import QuantizationError

    if args.method == "ort-int8":
        from moe_core.inference.quantize import quantize_onnx_dynamic

        out = quantize_onnx_dynamic(args.model_dir, args.out, overwrite=args.overwrite)
        print(f"wrote {out}")
        return 0
    if args.method == "optimum-gptq":
        from moe_core.inference.evaluate import calibration_batches
        from moe_core.inference.quantize import quantize_optimum_gptq

        # without --data, quantize_optimum_gptq says what is missing (the GPU backend first, then the data)
        calibration = (
            calibration_batches(args.data, args.calib_batches, args.calib_batch_size) if args.data else None
        )
        out = quantize_optimum_gptq(
            args.model_dir,
            args.out,
            calibration,
            bits=args.bits,
            group_size=args.group_size,
            architecture=args.hf_architecture,
            overwrite=args.overwrite,
        )
        print(f"wrote {out}")
        return 0
    from moe_core.inference.evaluate import calibration_batches
    from moe_core.inference.quantize import QuantConfig, quantize_checkpoint

    config = QuantConfig(bits=args.bits, group_size=args.group_size, method=args.method)
    calibration = None
    if args.method in ("gptq", "awq"):
        if not args.data:
            raise QuantizationError(
                f"--method {args.method} calibrates on real text: pass --data DIR "
                "(a prepared-data directory, moe-lab data prepare)"
            )
        calibration = calibration_batches(args.data, args.calib_batches, args.calib_batch_size)
    report = quantize_checkpoint(args.model_dir, args.out, config, calibration, overwrite=args.overwrite)
    print(
        json.dumps(report.to_dict())
        if args.json
        else f"{report.summary()}\nwrote {args.out} (report: quantization.json)"
    )
    return 0


def _prune(args: argparse.Namespace) -> int:
    from moe_core.inference.evaluate import calibration_batches
    from moe_core.inference.prune import PruneConfig, prune_checkpoint

    config = PruneConfig(
        keep_experts=args.keep,
        min_share=args.min_share,
        merge_similar=args.merge,
        criterion=args.criterion,
        renormalize=args.renormalize,
        pruned_choices=args.pruned_choices,
    )
    calibration = (
        calibration_batches(args.data, args.calib_batches, args.calib_batch_size) if args.data else None
    )
    report = prune_checkpoint(
        args.model_dir, args.profile, args.out, config, calibration, overwrite=args.overwrite
    )
    print(
        json.dumps(report.to_dict())
        if args.json
        else f"{report.summary()}\nwrote {args.out} (report: pruning.json)"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from moe_core.inference.generate import GenerationConfig, generate_cli

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        compile=args.compile,
    )
    report = generate_cli(
        args.model_dir,
        prompts,
        config,
        stream=not args.no_stream,
        out=sys.stdout,
        events_dir=args.events,
        expert_cache=args.expert_cache,
        json_lines=args.json,
        base=args.base,
    )
    if args.json:
        print(json.dumps(report), file=sys.stderr)
    else:
        figures = [
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in report.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        cache = report.get("expert_cache")
        if cache:
            asked = cache["hits"] + cache["misses"]
            figures.append(f"expert cache hit rate {cache['hit_rate']:.0%} ({cache['hits']} of {asked})")
            if cache["fallbacks"]:
                figures.append(f"{cache['fallbacks']} slots rerouted")
        print(f"moe-lab generate: {', '.join(figures)}", file=sys.stderr)
    return 0


def add_cli(subparsers) -> None:
    export = subparsers.add_parser("export", help="export a model for deployment")
    export_sub = export.add_subparsers(dest="export_format", required=True, metavar="FORMAT")
    onnx = export_sub.add_parser(
        "onnx", help="ONNX through torch.onnx (dynamo), with a KV cache (runs in ONNX Runtime)"
    )
    onnx.add_argument(
        "model_dir",
        type=existing_path("model"),
        help="our checkpoint, or a Hugging Face directory of an architecture `moe-lab convert` reads",
    )
    onnx.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    onnx.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    onnx.add_argument("--opset", type=int, default=18, help="ONNX opset (18: the exporter's own)")
    onnx.add_argument(
        "--no-validate",
        action="store_true",
        help="skip the export's check (every expert in the graph, logits at several shapes, a cached step)",
    )
    onnx.set_defaults(func=_export_onnx)
    add_router_module_option(onnx)
    gguf = export_sub.add_parser(
        "gguf",
        help="GGUF for llama.cpp (fp32), from a Hugging Face directory written by `moe-lab convert to-hf`: "
        "mixtral, olmoe, qwen2_moe, qwen3_moe, deepseek_v3/v2, gpt_oss, glm4_moe",
    )
    gguf.add_argument(
        "hf_dir", type=existing_path("model"), help="a Hugging Face MoE checkpoint with tokenizer.json"
    )
    gguf.add_argument(
        "--mla",
        choices=["split", "unsplit"],
        default="split",
        help="DeepSeek attention: split (llama.cpp's current attn_k_b/attn_v_b) or unsplit (one attn_kv_b, "
        "for llama.cpp builds before mid-2025)",
    )
    gguf.add_argument("--out", required=True, help="the .gguf file to write (must not exist)")
    gguf.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    gguf.set_defaults(func=_export_gguf)

    quantize = subparsers.add_parser(
        "quantize", help="int8/int4 weight-only experts, or ONNX Runtime dynamic int8"
    )
    quantize.add_argument(
        "model_dir",
        type=existing_path("model"),
        help="checkpoint directory (or an exported ONNX directory for ort-int8)",
    )
    quantize.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    quantize.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    quantize.add_argument("--json", action="store_true", help="print the whole report as one JSON line")
    quantize.add_argument(
        "--method",
        default="rtn",
        choices=["rtn", "gptq", "awq", "ort-int8", "optimum-gptq"],
        help="optimum-gptq: optimum's GPTQQuantizer on the HF architecture (CUDA + gptqmodel)",
    )
    quantize.add_argument(
        "--data",
        default=None,
        type=existing_path("data", urls=True),
        help="prepared-data directory whose train split calibrates gptq / awq / optimum-gptq",
    )
    quantize.add_argument("--calib-batches", type=int, default=16, help="calibration batches from --data")
    quantize.add_argument("--calib-batch-size", type=int, default=8)
    quantize.add_argument("--bits", type=int, default=8, choices=[4, 8])
    quantize.add_argument("--group-size", type=int, default=32, help="int4 group size along the input dim")
    quantize.add_argument(
        "--hf-architecture",
        choices=["mixtral", "olmoe", "qwen2_moe"],
        default=None,
        help="optimum-gptq: the HF architecture to quantize through (default: the model's origin)",
    )
    quantize.set_defaults(func=_quantize)
    add_router_module_option(quantize)

    prune = subparsers.add_parser(
        "prune", help="drop (or merge) low-ranked experts: routed slots or REAP saliency"
    )
    prune.add_argument("model_dir", type=existing_path("model"), help="checkpoint directory")
    prune.add_argument(
        "--profile",
        default=None,
        type=existing_path("profile"),
        help="a RouterProfile directory (moe-lab analyze): slot counts",
    )
    prune.add_argument(
        "--criterion",
        default="frequency",
        choices=["frequency", "reap"],
        help="rank experts by routed slots, or by REAP's router-weighted output norm (needs --data)",
    )
    prune.add_argument(
        "--data",
        default=None,
        type=existing_path("data", urls=True),
        help="prepared-data directory whose train split calibrates the ranking",
    )
    prune.add_argument("--calib-batches", type=int, default=16)
    prune.add_argument("--calib-batch-size", type=int, default=8)
    prune.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    prune.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    prune.add_argument("--json", action="store_true", help="print the whole report as one JSON line")
    prune.add_argument(
        "--keep", type=int, default=None, help="experts kept per layer (default: drop by --min-share)"
    )
    prune.add_argument("--min-share", type=float, default=0.0, help="drop experts below this share of slots")
    prune.add_argument(
        "--renormalize",
        action="store_true",
        help="norm_topk_prob=False models: softmax over the kept experts only (what HF OLMoE/Qwen2-MoE can "
        "express) instead of keeping the dropped experts' mass in the router's denominator",
    )
    prune.add_argument(
        "--pruned-choices",
        default="refill",
        choices=["refill", "drop"],
        help="a token's top-k choice of a dropped expert: refilled by its next-best kept expert, or its "
        "slot left empty (dropless top-k/switch routers with raw softmax weights)",
    )
    prune.add_argument(
        "--merge", action="store_true", help="merge each dropped expert into its most similar kept one"
    )
    prune.set_defaults(func=_prune)
    add_router_module_option(prune)

    generate = subparsers.add_parser(
        "generate",
        help="generate text from a model, streamed",
        description="Generate text from a checkpoint and its tokenizer: the first "
        "prompt's completion is streamed as it is decoded, the others "
        "follow; --json gives JSON lines for programs.",
    )
    generate.add_argument(
        "model_dir", type=existing_path("model"), help="checkpoint directory with a tokenizer"
    )
    generate.add_argument(
        "--base",
        default=None,
        type=existing_path("base model"),
        help="for a fine-tune's output that holds its adapter alone (or an adapter directory): where the base "
        "model it trained on is now, if it moved since (default: the path the output recorded)",
    )
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    generate.add_argument("--prompts-file", type=existing_path("prompts file"), help="one prompt per line")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--batch-size", type=int, default=8)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--no-stream", action="store_true", help="print each completion when it is done")
    generate.add_argument(
        "--json",
        action="store_true",
        help="JSON lines for programs (streamed pieces, then one completion per prompt; the "
        "figures as JSON on stderr) instead of text",
    )
    generate.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step on a static KV cache (slow first batch, faster decoding)",
    )
    generate.add_argument(
        "--expert-cache",
        type=int,
        default=None,
        metavar="N",
        help="keep only N experts in memory (the rest offloaded to disk, LRU)",
    )
    generate.add_argument(
        "--events",
        default=None,
        metavar="DIR",
        help="write live figures (tokens/s, cache hit rate, ...) to DIR/inference.jsonl for "
        "moe-lab dashboard (numbers only)",
    )
    generate.set_defaults(func=_generate)
    add_router_module_option(generate)
