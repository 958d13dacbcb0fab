"""The work on one part of a source (`moe_core.data.stream.partition_source`), as a distributed engine's task
runs it (`moe_core.data.prepare`, ``engine="ray"``), and the per-document work of the scan both engines share.

`document_facts` is what pass 1 needs of a document and nothing more: its sha256, sizes, domain and, with
near-deduplication, its MinHash LSH band keys. The local scan computes it for every document of the stream and
takes its decisions in order; `scan_part` computes it for the documents of one part, in a worker, and the
driver takes the same decisions over the parts' results in part order. The decisions that depend on what came
before (an exact duplicate keeps its first copy, a near-duplicate group its first member, domains are numbered
as first seen) stay in the driver, which holds a few bytes per document.

The bounded samples (`BottomK`, keyed by the document's hash) are chosen in the driver from every document's
key and size; the texts come from the parts: each returns its own bottom-k of the documents it cannot yet rule
out (a duplicate within the part is ruled out), which holds every document of the part the global sample
takes unless duplicates from earlier parts crowded it out; the driver reads those few from their part again.

`encode_part` is pass 2 of one part: it reads the part's documents itself (the driver sends the split and
domain ids of its kept documents, not their texts) and returns the tokens per split as `encode_chunk` does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_core.data.encode import encode_chunk
from moe_core.data.errors import DataError
from moe_core.data.minhash import NearDuplicates
from moe_core.data.sources import SourceSpec
from moe_core.data.stream import BottomK, Partition, StreamDocument, iter_documents


@dataclass(frozen=True)
class DocumentFacts:
    """What the scan needs of one non-blank document."""

    digest: bytes  # sha256 of its UTF-8 text
    nbytes: int  # of its UTF-8 text
    chars: int
    domain: str
    band_keys: tuple[int, ...] | None  # MinHash LSH band keys (near_dedup); None for a known exact duplicate


def document_facts(
    doc: StreamDocument, near: NearDuplicates | None, seen: set[bytes] | None = None
) -> DocumentFacts | None:
    """The scan's per-document work (both engines): None for a whitespace-only document (dropped: blank lines
    separate paragraphs in line-based corpora). A document whose digest (its first 16 bytes) is in ``seen``
    is an exact duplicate: its band keys, those of its first copy, are not computed."""
    if not doc.text.strip():
        return None
    raw = doc.text.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).digest()
    duplicate = seen is not None and digest[:16] in seen
    keys = tuple(near.band_keys(doc.text)) if near is not None and not duplicate else None
    return DocumentFacts(digest, len(raw), len(doc.text), doc.domain, keys)


@dataclass(frozen=True)
class SampleBounds:
    """The three bounded samples of the scan (`BottomK` bounds) and which documents may enter each."""

    validation: tuple[int, int] | None  # (max rows, max bytes); None: no suite to run
    tokenizer: int | None  # max bytes of train text; None: the tokenizer is given
    rate: int  # max bytes of kept text, to measure tokens per character
    eval_fraction: float  # u below this is validation or test: not in the tokenizer sample
    instruction: bool  # validation items are the raw records (instruction data), else {"text": ...}


def sample_keys(digest: bytes) -> tuple[int, int, int]:
    """The keys of the validation, tokenizer and rate samples: independent slices of the sha256."""
    return (
        int.from_bytes(digest[8:16], "big"),
        int.from_bytes(digest[16:24], "big"),
        int.from_bytes(digest[24:], "big"),
    )


def hash_fraction(digest: bytes) -> float:
    """u in [0, 1): the document's hash as a fraction (it decides the split)."""
    return int.from_bytes(digest[:8], "big") / 2**64


def new_samples(bounds: SampleBounds) -> tuple[BottomK | None, BottomK | None, BottomK]:
    val = BottomK(*bounds.validation) if bounds.validation is not None else None
    tok = BottomK(max_bytes=bounds.tokenizer) if bounds.tokenizer is not None else None
    return val, tok, BottomK(max_bytes=bounds.rate)


def sample_item(doc: StreamDocument, bounds: SampleBounds) -> Any:
    return doc.record if bounds.instruction else {"text": doc.text}


@dataclass
class PartScan:
    """`scan_part`'s answer: per record in order its facts (None: blank), the candidates of the part's
    samples by the index of the non-blank document in the part, and the error that stopped the read."""

    facts: list[DocumentFacts | None] = field(default_factory=list)
    validation: dict[int, Any] = field(default_factory=dict)
    tokenizer: dict[int, str] = field(default_factory=dict)
    rate: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # a DataError's message, with the line counted in the file


def scan_part(
    spec: SourceSpec, part: Partition, read: dict[str, Any], near_args: tuple | None, bounds: SampleBounds
) -> PartScan:
    """Pass 1 over one part (a task): `document_facts` of each record and the part's sample candidates. Bad
    input is returned, not raised, after the documents before it: the driver decides whether the stream
    reaches it (``max_documents``)."""
    near = NearDuplicates(*near_args) if near_args is not None else None
    out = PartScan()
    val, tok, rate = new_samples(bounds)
    seen: set[bytes] = set()  # digests (16 bytes) of the part's documents so far
    n_docs = 0
    try:
        # lines_before=0: no line numbers are needed unless a record is bad (then counted, below)
        for doc in iter_documents(spec, part=part, lines_before=0, **read):
            facts = document_facts(doc, near, seen)
            out.facts.append(facts)
            if facts is None:
                continue
            i = n_docs
            n_docs += 1
            k_val, k_tok, k_rate = sample_keys(facts.digest)
            if val is not None:
                val.add(k_val, i, facts.nbytes, sample_item(doc, bounds))
            if facts.digest[:16] in seen:  # a duplicate: in no sample of kept documents
                continue
            seen.add(facts.digest[:16])
            if tok is not None and hash_fraction(facts.digest) >= bounds.eval_fraction:
                tok.add(k_tok, i, facts.nbytes, doc.text)
            rate.add(k_rate, i, facts.nbytes, doc.text)
    except DataError:
        try:  # again, counting the part's first line in its file, so the error names the file's line
            for _ in iter_documents(spec, part=part, lines_before=None, **read):
                pass
        except DataError as err:
            out.error = str(err)
        else:
            raise
    for sample, into in ((val, out.validation), (tok, out.tokenizer), (rate, out.rate)):
        if sample is not None:
            into.update(sample.items())
    return out


def encode_part(
    spec: SourceSpec,
    part: Partition,
    read: dict[str, Any],
    skip: int,
    split_ids: np.ndarray,
    domain_ids: np.ndarray,
    tokenizer_json: str,
    eos_token_id: int,
    append_eos: bool,
    whole: bool = True,
) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], int]:
    """Pass 2 over one part (a task): its non-blank documents after the first ``skip`` (done before a
    resume), ``len(split_ids)`` of them, tokenized (`encode_chunk`) with the given split (-1: removed) and
    domain ids. Returns the per-split results and the characters read. Raises `DataError` when the part no
    longer holds that many documents (the source changed since the scan), or (``whole``: the scan read all
    of the part) more."""
    texts: list[str] = []
    sids: list[int] = []
    doms: list[int] = []
    n = chars = 0
    want = len(split_ids)
    for doc in iter_documents(spec, part=part, lines_before=0, check=False, **read):  # the scan checked it
        if not doc.text.strip():
            continue
        if n >= skip + want and not whole:
            break
        if skip <= n < skip + want and split_ids[n - skip] >= 0:
            texts.append(doc.text)
            sids.append(int(split_ids[n - skip]))
            doms.append(int(domain_ids[n - skip]))
            chars += len(doc.text)
        n += 1
    if n < skip + want or (whole and n != skip + want):
        raise DataError(
            f"{spec.name}: changed while it was being prepared ({n} documents now in a part of "
            f"{part.path or 'the source'} where the scan found {skip + want}); prepare it again "
            "with --overwrite once it stops changing"
        )
    return encode_chunk(tokenizer_json, eos_token_id, append_eos, texts, sids, doms), chars


__all__ = ["DocumentFacts", "PartScan", "SampleBounds", "document_facts", "encode_part", "scan_part"]
