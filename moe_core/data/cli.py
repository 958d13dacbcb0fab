"""`moe-lab data validate|prepare`: heavy imports (datasets, great_expectations) happen in the handlers.

moe-lab data validate data/train.jsonl --kind text          # prints the report; exit 0 pass, 1 fail
moe-lab data prepare builtin --out runs/data --max-documents 200 --vocab-size 2000
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import json
import sys
from pathlib import Path

from moe_core.data.errors import DataError
from moe_core.fileio import atomic_file, check_output_file


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-column", default="text", help="column holding the text (json/csv/parquet/hub)")
    p.add_argument("--domain-column", default=None, help="column of domain labels (optional)")
    p.add_argument("--hub-config", default=None, help="hub dataset config, e.g. wikitext-103-raw-v1")
    p.add_argument("--split", default="train", help="hub dataset split to read (default: train)")
    p.add_argument("--max-documents", type=int, default=None, help="read at most this many documents")
    p.add_argument(
        "--txt-sample-by",
        default="paragraph",
        choices=("paragraph", "line", "document"),
        help=".txt files: what one document is (default: paragraph)",
    )
    p.add_argument(
        "--sample-rows",
        type=int,
        default=None,
        help="validate a deterministic sample of this many rows, chosen by row hash (default: every row up to "
        "100,000 for validate, 20,000 for prepare; a sample of that size beyond)",
    )
    p.add_argument("--max-duplicate-ratio", type=float, default=0.1, help="exact-duplicate ratio bound")
    p.add_argument("--min-rows", type=int, default=1, help="fewest rows the data must have")


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="validate and prepare training data")
    sub = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")

    v = sub.add_parser(
        "validate", help="run the great-expectations suite of a data kind and print the report"
    )
    v.add_argument("source", help="'builtin', a file, directory or glob, or a hub id (hf:owner/name)")
    v.add_argument("--kind", default="text", choices=("text", "instruction", "preference"))
    _source_args(v)
    v.add_argument("--report", type=Path, default=None, help="also write the markdown report here")
    v.add_argument(
        "--json", dest="json_out", type=Path, default=None, help="also write the result as JSON here"
    )
    v.add_argument("--overwrite", action="store_true", help="replace an existing --report / --json file")
    v.set_defaults(func=_validate)

    p = sub.add_parser("prepare", help="validate, tokenize and pack a source into token shards")
    p.add_argument("source", nargs="?", default="builtin", help="as for validate (default: builtin)")
    p.add_argument("--out", type=Path, required=True, help="the prepared directory to write")
    p.add_argument("--kind", default="text", choices=("text", "instruction"))
    _source_args(p)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument(
        "--tokenizer", default=None, help="existing tokenizer (directory or hub id); default: train one"
    )
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--test-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-proc", type=int, default=1, help="tokenizer processes (the shards are the same for any number)"
    )
    p.add_argument(
        "--engine",
        default="local",
        choices=("local", "ray"),
        help="local: this process reads and scans, --num-proc processes tokenize; ray: tasks on the cluster "
        "RAY_ADDRESS names (a local one without it) read, scan and tokenize the parts of the source; the "
        "shards are the same",
    )
    p.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=32.0,
        help="train a new tokenizer on at most this many MB of train text, chosen by document hash (default 32)",
    )
    p.add_argument(
        "--near-dedup",
        type=float,
        default=None,
        metavar="THRESHOLD",
        help="also remove near-duplicates (MinHash LSH) at this Jaccard similarity, e.g. 0.8 (default: off)",
    )
    p.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"))
    p.add_argument("--no-validate", action="store_true", help="skip the expectation suite")
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it holds other prepared data")
    p.set_defaults(func=_prepare)


def _validation_config(args: argparse.Namespace, seed: int = 0):  # -> ValidationConfig
    from moe_core.data.validation import ValidationConfig

    return ValidationConfig(
        sample_rows=args.sample_rows,
        max_duplicate_ratio=args.max_duplicate_ratio,
        min_rows=args.min_rows,
        seed=seed,
    )


def _validate(args: argparse.Namespace) -> int:
    from moe_core.data.validation import validate_source

    for path in (p for p in (args.report, args.json_out) if p is not None):  # before reading the data
        check_output_file(path, args.overwrite, DataError)
    result = validate_source(
        args.source,
        kind=args.kind,
        config=_validation_config(args),
        text_column=args.text_column,
        domain_column=args.domain_column,
        hub_config=args.hub_config,
        split=args.split,
        max_documents=args.max_documents,
        txt_sample_by=args.txt_sample_by,
    )
    report = result.to_markdown()
    print(report)
    for path, text in ((args.report, report), (args.json_out, json.dumps(result.to_dict(), indent=1))):
        if path is not None:
            with atomic_file(path, args.overwrite, DataError) as tmp:  # a whole report or none
                tmp.write_text(text)
    return 0 if result.success else 1


def _prepare(args: argparse.Namespace) -> int:
    from moe_core.data.errors import DataValidationError
    from moe_core.data.prepare import PrepareConfig, prepare
    from moe_core.data.shards import read_manifest

    config = PrepareConfig(
        source=args.source,
        kind=args.kind,
        text_column=args.text_column,
        domain_column=args.domain_column,
        hub_config=args.hub_config,
        split=args.split,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
        seed=args.seed,
        max_documents=args.max_documents,
        num_proc=args.num_proc,
        engine=args.engine,
        tokenizer_sample_bytes=round(args.tokenizer_sample_mb * 1e6),
        near_dedup=args.near_dedup,
        dtype=args.dtype,
        validate=not args.no_validate,
        validation=_validation_config(args, args.seed),
        txt_sample_by=args.txt_sample_by,
    )
    try:
        out = prepare(config, args.out, overwrite=args.overwrite)
    except DataValidationError as err:
        print(err.result.to_markdown())
        raise
    manifest = read_manifest(out)
    splits = {
        name: {k: s[k] for k in ("documents", "num_blocks", "num_tokens")}
        for name, s in manifest["splits"].items()
    }
    print(
        json.dumps(
            {
                "out": str(out),
                "tokenizer_hash": manifest["tokenizer"]["hash"][:16],
                "vocab_size": manifest["tokenizer"]["vocab_size"],
                "dtype": manifest["dtype"],
                "counts": manifest["counts"],
                "splits": splits,
            }
        ),
        file=sys.stdout,
    )
    return 0
