"""`moe-lab analyze`: thin argument parsing over `moe_core.analytics` (router profile, pictures, cost report).

    moe-lab analyze --model runs/x --data runs/data --out runs/x/analysis [--device-name h100]

The model options are eval's (`moe_core.eval.cli.add_model_options`): ``--model`` is a model directory or a
training output directory, ``--preset NAME`` a randomly initialised model. Heavy imports happen inside the
handler. Output files only hold numbers, hashes and vocabulary entries; nothing here prints training text.
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import json
import sys
from pathlib import Path

from moe_core.cli import add_router_module_option
from moe_core.errors import MoELabError
from moe_core.eval.cli import add_model_options, data_vocab, load_model, load_tokenizer_for, write_text
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.paths import existing_path


def add_cli(subparsers) -> None:
    an = subparsers.add_parser(
        "analyze",
        help="router profile, pictures and cost report",
        description="Profile the router on an evaluation split (saved as a versioned "
        "profile), draw the pictures and write the cost report.",
    )
    add_model_options(an)
    an.add_argument(
        "--data", type=existing_path("data", urls=True), help="prepared-data directory (moe-lab data prepare)"
    )
    an.add_argument("--split", default="validation")
    an.add_argument("--batch-size", type=int, default=8)
    an.add_argument("--max-batches", type=int, default=16)
    an.add_argument(
        "--out",
        required=True,
        help="output directory (empty or absent): profile/, plots/, cost.json, cost.md",
    )
    an.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    an.add_argument("--top-tokens", type=int, default=10)
    an.add_argument(
        "--vocab-pieces",
        action="store_true",
        help="write each top token's vocabulary piece (string) beside its id and count",
    )
    an.add_argument("--rare-fraction", type=float, default=0.1)
    an.add_argument("--no-plots", action="store_true")
    an.add_argument(
        "--text", default=None, help="text for the token-to-expert heatmap (default: a project prompt)"
    )
    an.add_argument(
        "--device-name",
        default=None,
        help="device to price (default: this machine's, e.g. 'cpu' or the CUDA device name)",
    )
    an.add_argument("--price-table", default=None, help='JSON {"device": usd_per_hour} over the defaults')
    an.add_argument("--throughput-batch", type=int, default=4)
    an.add_argument("--throughput-seq", type=int, default=None, help="default: the data's seq_len or 256")
    an.add_argument("--throughput-steps", type=int, default=3)
    an.add_argument("--events", default=None, help="training JSONL event file, for the training cost to date")
    an.add_argument("--train-tokens", type=int, default=None)
    an.add_argument("--train-seconds", type=float, default=None)
    an.add_argument(
        "--train-device", default=None, help="device the training ran on (default: --device-name)"
    )
    an.add_argument("--train-devices", type=int, default=1)
    an.set_defaults(func=run_analyze)
    add_router_module_option(an)


# ------------------------------------------------------------------------------------------------ analyze
def run_analyze(args) -> int:
    if not args.data:
        raise MoELabError(
            "moe-lab analyze needs --data DIR (a prepared-data directory to profile the router on)"
        )

    out = check_output_dir(args.out, args.overwrite, MoELabError)  # before anything expensive
    # profile, plots and cost appear in --out together when the analysis is done, or not at all
    with atomic_directory(out, args.overwrite, MoELabError) as stage:
        report = _analyze(args, stage)
    print(report.to_markdown())
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _analyze(args, out: Path):
    """Profile, pictures and cost report of `run_analyze`, written into ``out`` (the staging directory);
    returns the cost report."""
    import torch

    from moe_core.analytics.cost import (
        PriceTable,
        TrainingUsage,
        cost_report,
        measure_throughput,
        usage_from_events,
    )
    from moe_core.analytics.profile import ProfileConfig, profile_split
    from moe_core.data.shards import read_manifest
    from moe_core.eval.perplexity import to_markdown

    model = load_model(args, vocab_size=data_vocab(args))
    tokenizer = load_tokenizer_for(args, required=False)
    profile = profile_split(
        model,
        args.data,
        args.split,
        args.batch_size,
        args.max_batches,
        ProfileConfig(
            top_tokens=args.top_tokens,
            rare_fraction=args.rare_fraction,
            include_vocab_pieces=args.vocab_pieces,
        ),
        tokenizer,
    )
    profile.to_dir(out / "profile")
    summary = profile.summary()
    print(to_markdown(summary.drop(columns=["dead_experts", "rare_experts"])))
    if not args.no_plots:
        from moe_core.analytics.plots import render_all

        token_ids = tokenizer.encode(args.text, add_special_tokens=False) if args.text and tokenizer else None
        render_all(profile, out / "plots", model=model, token_ids=token_ids, tokenizer=tokenizer)

    device = next(model.parameters()).device
    device_name = args.device_name or (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    prices = PriceTable.from_file(args.price_table) if args.price_table else PriceTable()
    seq_len = args.throughput_seq or int(read_manifest(args.data)["seq_len"])
    throughput = measure_throughput(model, args.throughput_batch, seq_len, args.throughput_steps)
    training = None
    train_device = args.train_device or device_name
    if args.events:
        training = usage_from_events(args.events, train_device, args.train_devices)
    elif args.train_tokens is not None and args.train_seconds is not None:
        training = TrainingUsage(args.train_tokens, args.train_seconds, train_device, args.train_devices)
    drop_rate = float(
        sum(x.dropped_slots for x in profile.layers) / max(sum(x.slots for x in profile.layers), 1)
    )
    report = cost_report(
        model.config, throughput.tokens_per_s, device_name, seq_len, prices, drop_rate, training
    )
    cost = {**report.to_dict(), "throughput": vars(throughput)}
    write_text(out / "cost.json", json.dumps(cost, indent=2, default=str) + "\n")
    write_text(out / "cost.md", report.to_markdown() + "\n")
    return report
