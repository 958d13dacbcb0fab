"""Tokenization of document chunks, in this process or in `--num-proc` worker processes.

A chunk is a run of consecutive documents of the stream with their split and domain ids; `Encoder.encode`
returns, per split, the token ids of its documents joined by EOS (uint32) and the domain id of every token
(uint8). Chunks are cut by the reader and their results are appended in stream order, so the packed shards are
the same for any number of workers.

This module imports only numpy and `tokenizers`: worker processes are started with "spawn" (a fork after the
tokenizer trainer's threads ran can deadlock), and each imports only this.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
from tokenizers import Tokenizer

N_SPLITS = 3


class Encoder:
    """The backend (Rust) tokenizer of a transformers fast tokenizer, from its JSON. ``encode_batch_fast`` with
    ``add_special_tokens=False`` gives the ids of ``tokenizer(texts, add_special_tokens=False)`` without the
    character offsets nothing here reads (1.3x ``encode_batch``'s rate on the built-in corpus); with
    ``batch=False`` the documents are encoded one by one (same ids, one core)."""

    def __init__(self, tokenizer_json: str, eos_token_id: int, append_eos: bool, batch: bool = True) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.eos, self.append_eos, self.batch = eos_token_id, append_eos, batch

    def encode(
        self, texts: list[str], split_ids: list[int], domain_ids: list[int]
    ) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Per split k: (tokens uint32, domain id per token uint8, documents) of the chunk's documents of k."""
        if self.batch:  # on the library's thread pool (single-threaded in workers: init_worker)
            ids = [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        else:
            ids = [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        extra = 1 if self.append_eos else 0
        out = []
        for k in range(N_SPLITS):
            docs = [j for j, s in enumerate(split_ids) if s == k]
            lengths = [len(ids[j]) + extra for j in docs]
            total = sum(lengths)
            pieces = (ids[j] + [self.eos] if extra else ids[j] for j in docs)
            tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.uint32, count=total)
            domains = np.repeat(np.asarray([domain_ids[j] for j in docs], dtype=np.uint8), lengths)
            out.append((tokens, domains, len(docs)))
        return out


_worker: Encoder | None = None


def init_worker(tokenizer_json: str, eos_token_id: int, append_eos: bool) -> None:
    """Pool initializer: one single-threaded encoder per worker (the workers are the parallelism)."""
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = Encoder(tokenizer_json, eos_token_id, append_eos)


def encode_in_worker(
    texts: list[str], split_ids: list[int], domain_ids: list[int]
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    if _worker is None:
        raise RuntimeError("encode_in_worker runs in a pool started with init_worker")
    return _worker.encode(texts, split_ids, domain_ids)


_by_tokenizer: dict[tuple[int, int, bool], Encoder] = {}


def encode_chunk(
    tokenizer_json: str, eos_token_id: int, append_eos: bool, texts: list[str], split_ids, domain_ids
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """One chunk as a task of a distributed engine (Ray): the encoder is built once per worker process and
    tokenizer, single-threaded (the engine's workers are the parallelism)."""
    key = (hash(tokenizer_json), eos_token_id, append_eos)
    if key not in _by_tokenizer:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        _by_tokenizer[key] = Encoder(tokenizer_json, eos_token_id, append_eos)
    return _by_tokenizer[key].encode(texts, split_ids, domain_ids)
