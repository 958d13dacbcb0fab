"""`moe-lab eval`: loss and perplexity per split, a comparison table against other models (dense
baselines), generations for the project's prompts, lm-eval tasks; thin argument parsing over `moe_core.eval`.

    moe-lab eval --model runs/x --data runs/data [--compare dense=runs/dense] [--generate] [--tasks T]

``--model`` is a model directory (``save_pretrained`` / an exported or step checkpoint) or a training output
directory (its latest checkpoint is used); ``--preset NAME`` builds a randomly initialised model instead (a
smoke test of the pipeline). Heavy imports happen inside the handlers. Output files only hold numbers and
generations for the project's own prompts; nothing here prints training text.

The model options and loaders below (`add_model_options`, `load_model`, `load_tokenizer_for`) serve
``moe-lab analyze`` too (`moe_core.analytics.cli`, above eval); they are the seam where the one model loader,
``moe_core.load``, takes over.
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from moe_core.cli import add_router_module_option, preset_help
from moe_core.errors import MoELabError
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.paths import existing_path, require_local


def add_cli(subparsers) -> None:
    ev = subparsers.add_parser(
        "eval",
        help="loss/perplexity per split, comparison table, generations, lm-eval",
        description="Evaluate a model: loss and perplexity on prepared splits, a table "
        "against other models (dense baselines), generations, lm-eval tasks.",
    )
    add_model_options(ev)
    ev.add_argument(
        "--data", type=existing_path("data", urls=True), help="prepared-data directory (moe-lab data prepare)"
    )
    ev.add_argument(
        "--splits", default="validation,test", help="comma-separated splits (default: %(default)s)"
    )
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--max-batches", type=int, default=None, help="per split (default: all)")
    ev.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another model to put in the table, e.g. dense=runs/dense-total (repeatable)",
    )
    ev.add_argument(
        "--preferences",
        default=None,
        metavar="FILE",
        help="held-out preference pairs (prompt/chosen/rejected): a reward model's pairwise accuracy",
    )
    ev.add_argument("--generate", action="store_true", help="greedy + sampled generations for the prompt set")
    ev.add_argument("--max-new-tokens", type=int, default=48)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (needs lm-eval)")
    ev.add_argument("--include-path", default=None, help="directory of local lm-eval YAML tasks")
    ev.add_argument("--limit", type=float, default=None, help="lm-eval examples per task")
    ev.add_argument(
        "--out", default=None, help="write eval.json, comparison.md, generations.jsonl here (empty or absent)"
    )
    ev.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    ev.set_defaults(func=run_eval)
    add_router_module_option(ev)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model DIR | --preset NAME, --tokenizer, --device: what eval and analyze load."""
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--model", type=existing_path("model"), help="model directory, or a training output directory"
    )
    group.add_argument(
        "--preset", help=preset_help("a config preset with random weights (pipeline smoke test)")
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        type=existing_path("tokenizer"),
        help="tokenizer directory (default: the model directory's own, else the data's)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument(
        "--base",
        default=None,
        type=existing_path("base model"),
        help="for a fine-tune's output that holds its adapter alone (or an adapter directory): where the base "
        "model it trained on is now, if it moved since (default: the path the output recorded)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the weights' dtype; auto: float32 up to 1 B parameters, above that the dtype the checkpoint holds "
        "(a float32 copy of a published bf16 MoE is twice its size; a fine-tune's output then loads as it trained)",
    )


# ------------------------------------------------------------------ model loading for eval and analyze
def load_model(args, path: str | None = None, vocab_size: int | None = None):
    """The model at ``path`` (default ``--model``: any checkpoint kind `moe_core.load` reads), else the
    ``--preset`` with random weights."""
    import torch

    from moe_core import MoEForCausalLM, get_config, load

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = path or args.model
    if path:
        base = args.base if path == args.model else None  # --base is --model's (not a compared model's)
        model = load(path, dtype=model_dtype(args, path, base), base=base).model
    else:
        overrides = {"vocab_size": vocab_size} if vocab_size else {}
        torch.manual_seed(0)
        model = MoEForCausalLM(get_config(args.preset, **overrides))
    return model.to(device).eval()


def model_dtype(args, path: str, base: str | None = None):
    """``--dtype`` as `moe_core.load` takes it; auto is `moe_core.finetune.sizing.read_dtype`'s rule: float32 up to
    1 B parameters, above that the stored dtype (None), said in one line."""
    import torch  # the handlers' heavy imports happen here (module comment)

    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    # the size rule is the fine-tuning defaults' (sizing is light: configs only)
    from moe_core.finetune.sizing import read_dtype

    return read_dtype(path, None, base, doing="evaluated", hint="; --dtype float32 asks for float32")


def load_tokenizer_for(args, required: bool):
    """--tokenizer, else the model directory's own (a trained model's final/ holds the tokenizer it was
    trained with), else the prepared data's."""
    from moe_core.loading import tokenizer_dir

    source = args.tokenizer
    if source is None and args.model:
        source = tokenizer_dir(args.model)
    source = source or args.data
    if source is None:
        if required:
            raise MoELabError(
                "a tokenizer is needed: the model directory holds none; pass --tokenizer DIR or "
                "--data DIR (prepared data)"
            )
        return None
    from moe_core.data.tokenizer import load_tokenizer

    return load_tokenizer(source)


def data_vocab(args) -> int | None:
    if not args.data:
        return None
    from moe_core.data.shards import read_manifest

    return int(read_manifest(args.data)["tokenizer"]["vocab_size"])


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ------------------------------------------------------------------------------------------------ eval
def run_eval(args) -> int:
    out = Path(args.out) if args.out else None
    if out is not None:
        check_output_dir(out, args.overwrite, MoELabError)  # before anything expensive
    # the reports appear in --out together when the evaluation is done, or not at all
    staged = atomic_directory(out, args.overwrite, MoELabError) if out is not None else nullcontext()
    with staged as stage:
        _evaluate(args, stage)
    if out is not None:
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _evaluate(args, out: Path | None) -> dict[str, Any]:
    """What `run_eval` reports, its files written into ``out`` (the staging directory) when given."""
    from moe_core.eval.compare import compare_models
    from moe_core.loading import Loaded

    model = load_model(args, vocab_size=data_vocab(args))
    report: dict[str, Any] = {"model": args.model or f"preset:{args.preset}"}
    splits = [s for s in args.splits.split(",") if s]
    if args.data:
        models = {report["model"]: report["model"]}  # name -> what `load_model` reads (the first: loaded)
        for spec in args.compare:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise MoELabError(f"--compare {spec!r}: expected NAME=PATH, e.g. dense=runs/dense")
            models[name] = str(require_local(path, f"--compare {name}"))

        def load_for_comparison(path: str) -> Loaded:
            other = model if path == report["model"] else load_model(args, path=path)
            return Loaded(other, "model", Path(path), other.config)

        comparison = compare_models(
            models,
            args.data,
            splits,
            args.batch_size,
            args.max_batches,
            bits_per_byte=False,
            load=load_for_comparison,
        )
        report["splits"] = {k: v.to_dict() for k, v in comparison.results[report["model"]].items()}
        if comparison.warning:
            print(f"moe-lab eval: warning: {comparison.warning}", file=sys.stderr)
            report["warning"] = comparison.warning
        report["comparison"] = comparison.records()
        markdown = comparison.markdown()
        print(markdown)
        if out:
            write_text(out / "comparison.md", markdown + "\n")
    elif not (args.generate or args.tasks or args.preferences):
        raise MoELabError(
            "nothing to evaluate: pass --data DIR (loss/perplexity), --generate, --tasks or --preferences FILE "
            "(a reward model)"
        )
    if args.preferences:
        from moe_core.data.framing import read_framing
        from moe_core.eval.reward import preference_accuracy
        from moe_core.loading import tokenizer_dir

        framing = read_framing(tokenizer_dir(args.model)) if args.model and not args.tokenizer else None
        report["preferences"] = preference_accuracy(
            model,
            load_tokenizer_for(args, required=True),
            args.preferences,
            framing=framing,
            batch_size=args.batch_size,
        )
        print(json.dumps(report["preferences"], indent=2))
    tokenizer = load_tokenizer_for(args, required=bool(args.generate or args.tasks))
    if args.generate:
        from moe_core.data.framing import read_framing
        from moe_core.eval.generate import PromptSetConfig, generate_samples, write_generations
        from moe_core.loading import tokenizer_dir

        # a fine-tune's prompts framed as its training framed them (prompt_framing.json beside its tokenizer)
        framing = read_framing(tokenizer_dir(args.model)) if args.model and not args.tokenizer else None
        generations = generate_samples(
            model,
            tokenizer,
            config=PromptSetConfig(max_new_tokens=args.max_new_tokens, seed=args.seed),
            framing=framing,
        )
        report["generations"] = len(generations)
        if out:
            write_generations(generations, out / "generations.jsonl")
        else:
            for g in generations:
                print(f"--- {g.prompt} [{g.mode}]\n{g.prompt_text}{g.completion}")
    if args.tasks:
        try:
            from moe_core.eval.harness import MoELabLM, run_tasks
        except ImportError as err:
            raise MoELabError(str(err)) from None
        limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
        report["lm_eval"] = run_tasks(
            MoELabLM(model, tokenizer), args.tasks.split(","), args.include_path, limit, seed=args.seed
        )
        print(json.dumps(report["lm_eval"], indent=2, default=str))
    if out:
        write_text(out / "eval.json", json.dumps(report, indent=2, default=str) + "\n")
    return report
