"""Tokenization + packing throughput (tokens/s) on the built-in corpus.

Trains one byte-level BPE tokenizer on the documents, then measures, in one process and interleaved round by
round (so machine noise hits all alike):
  direct      one batched tokenizer call on all documents + packing (the floor: no `datasets`)
  map-N       `moe_core.data.prepare.tokenize_documents` (datasets.map, batched, N processes) + packing
Packing writes the memory-mapped shards (with sha256) into a temporary directory, as `prepare` does.

Prints tokens/s and ratios against `direct`, then one JSON line.

    python benchmarks/data_prep.py                        # 400 documents, vocab 8000, seq_len 256
    python benchmarks/data_prep.py --max-documents 0      # the whole corpus
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_core.data.prepare import PrepareConfig, tokenize_documents
from moe_core.data.shards import write_split_shards
from moe_core.data.sources import builtin_corpus
from moe_core.data.tokenizer import train_tokenizer


def pack(tokens: np.ndarray, domains: np.ndarray, seq_len: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        return write_split_shards(Path(tmp), "train", tokens, domains, seq_len, "uint16", 8192)["num_tokens"]


def run_direct(tokenizer, texts, domain_ids, seq_len):
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    tokens = np.fromiter((t for x in ids for t in (*x, eos)), dtype=np.int64)
    domains = np.repeat(np.asarray(domain_ids, np.uint8), [len(x) + 1 for x in ids])
    return len(tokens), pack(tokens, domains, seq_len)


def run_map(config, tokenizer, texts, domain_ids):
    per_split = tokenize_documents(config, tokenizer, texts, domain_ids, [0] * len(texts))
    tokens, domains, _ = per_split["train"]
    return len(tokens), pack(tokens, domains, config.seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-documents", type=int, default=400, help="0 = the whole corpus")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="datasets.map process counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    t0 = time.perf_counter()
    docs = builtin_corpus(args.max_documents or None)
    corpus_s = time.perf_counter() - t0
    texts = [d.text for d in docs]
    names = sorted({d.domain for d in docs})
    domain_ids = [names.index(d.domain) for d in docs]
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    train_s = time.perf_counter() - t0
    n_bytes = sum(len(t.encode()) for t in texts)
    print(
        f"corpus: {len(docs)} documents, {n_bytes / 1e6:.2f} MB, built in {corpus_s:.1f}s; "
        f"tokenizer (vocab {args.vocab_size}) trained in {train_s:.1f}s"
    )

    variants = {"direct": lambda: run_direct(tokenizer, texts, domain_ids, args.seq_len)}
    for n in args.procs:
        config = PrepareConfig(seq_len=args.seq_len, num_proc=n)
        variants[f"map-{n}"] = lambda config=config: run_map(config, tokenizer, texts, domain_ids)
    times: dict[str, list[float]] = {k: [] for k in variants}
    n_tokens = {}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            n_tokens[name], _packed = fn()
            times[name].append(time.perf_counter() - t0)
    assert len(set(n_tokens.values())) == 1, f"variants disagree on the token count: {n_tokens}"
    tokens = n_tokens["direct"]
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(
        f"{tokens} tokens ({n_bytes / tokens:.2f} bytes/token), median of {args.rounds} rounds, "
        f"{os.cpu_count()} CPU cores"
    )
    for name, value in tps.items():
        print(f"  {name:8s} {value / 1e6:7.3f} M tokens/s   x{value / tps['direct']:.2f} of direct")
    print(
        json.dumps(
            {
                "benchmark": "data_prep",
                "documents": len(docs),
                "bytes": n_bytes,
                "tokens": tokens,
                "vocab_size": args.vocab_size,
                "seq_len": args.seq_len,
                "rounds": args.rounds,
                "tokens_per_s": {k: round(v) for k, v in tps.items()},
                "ratio_vs_direct": {k: round(v / tps["direct"], 3) for k, v in tps.items()},
                "tokenizer_train_s": round(train_s, 2),
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
