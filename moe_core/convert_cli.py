"""`moe-lab convert from-hf | to-hf`: the command line of moe_core.convert (which imports torch and the
model, so it is imported only when a conversion runs).

    moe-lab convert from-hf mistralai/Mixtral-8x7B-v0.1 --out runs/mixtral
    moe-lab convert to-hf runs/a/final --arch mixtral --out runs/a/hf
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse

# the keys of moe_core.convert.DTYPES and ARCHITECTURES (tests/test_cli_help.py holds them equal)
DTYPE_CHOICES = ("bfloat16", "float16", "float32")
ARCH_CHOICES = (
    "mixtral",
    "olmoe",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe",
)


HELP = """Exact conversion between the lab's checkpoints and Hugging Face Mixtral / OLMoE / Qwen2-MoE /
Qwen3-MoE / gpt-oss / DeepSeek-V3 / DeepSeek-V2 / GLM-4.5 ones.

    moe-lab convert from-hf mistralai/Mixtral-8x7B-v0.1 --out runs/mixtral
    moe-lab convert to-hf runs/a/final --arch mixtral --out runs/a/hf
"""


def _cli_from_hf(args: argparse.Namespace) -> int:
    from moe_core.paths import require_model_source

    require_model_source(args.source, "convert from-hf")  # before importing torch and the model
    from moe_core.convert import convert_from_hf

    out = convert_from_hf(
        args.source, args.out, dtype=args.dtype, overwrite=args.overwrite, revision=args.revision
    )
    print(f"wrote moe_lab checkpoint to {out}")
    return 0


def _cli_to_hf(args: argparse.Namespace) -> int:
    from moe_core.paths import require_local

    require_local(args.source, "convert to-hf")  # before importing torch and the model
    from moe_core.hf_export import convert_to_hf

    out = convert_to_hf(args.source, args.out, architecture=args.arch, overwrite=args.overwrite)
    print(f"wrote Hugging Face checkpoint to {out}")
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="exact conversion to and from Hugging Face MoE checkpoints", description=HELP
    )
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    from_parser = sub.add_parser(
        "from-hf", help=f"Hugging Face checkpoint ({' / '.join(ARCH_CHOICES)}) -> moe_lab checkpoint"
    )
    from_parser.add_argument("source", help="HF checkpoint directory or hub id")
    from_parser.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    from_parser.add_argument("--dtype", choices=DTYPE_CHOICES, help="default: the checkpoint's own dtype")
    from_parser.add_argument("--revision", help="hub revision (branch, tag or commit)")
    from_parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    from_parser.set_defaults(func=_cli_from_hf)
    to_parser = sub.add_parser(
        "to-hf", help=f"moe_lab checkpoint -> Hugging Face checkpoint ({' / '.join(ARCH_CHOICES)})"
    )
    to_parser.add_argument("source", help="moe_lab checkpoint directory (save_pretrained)")
    to_parser.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    to_parser.add_argument(
        "--arch",
        choices=ARCH_CHOICES,
        help="target architecture; default: the one the model was converted from",
    )
    to_parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    to_parser.set_defaults(func=_cli_to_hf)
