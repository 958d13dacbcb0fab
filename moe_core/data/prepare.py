"""Prepare a source for training: scan -> validate -> split -> dedup -> tokenizer -> tokenize + pack -> shards.

    from moe_core.data.prepare import PrepareConfig, prepare
    data_dir = prepare(PrepareConfig(source="builtin", max_documents=200, vocab_size=2000), "runs/data")

The source is read as a stream (`moe_core.data.stream.iter_documents`), twice, and memory stays bounded
whatever its size (a few bytes per document, one tokenizer sample, one shard per split):

  1. scan: every document is hashed (sha256 of its text); whitespace-only documents are dropped (blank lines
     separate paragraphs in line-based corpora such as WikiText). The hash decides the split (train /
     validation / test; independent of the seed and of the order of the source), exact duplicates (same
     hash, first kept) and, with ``near_dedup``, near-duplicates (MinHash LSH, `moe_core.data.minhash`).
     Two bounded samples are kept, chosen by hash (`BottomK`): up to ``tokenizer_sample_bytes`` of train
     documents for the tokenizer, and up to ``validation_max_rows`` rows (or ``validation.sample_rows``) for
     the great-expectations suite; a failed suite raises `DataValidationError` before anything is written;
  2. tokenizer: a byte-level BPE trained on the sample, or ``config.tokenizer`` loaded;
  3. tokenize + pack: chunks of consecutive documents are tokenized in this process or in ``num_proc``
     worker processes (`moe_core.data.encode`), and their tokens, documents joined by EOS, are appended in
     stream order to one `ShardWriter` per split, which writes each [blocks, seq_len] shard (uint16 when the
     vocabulary fits, else uint32, plus a uint8 array of domain ids per token) as soon as it is full.

With ``engine="ray"`` (`pip install .[ray]`) the reading and the per-document work run as Ray tasks on the
cluster ``RAY_ADDRESS`` names (a local one without it): the source is cut into parts
(`moe_core.data.stream.partition_source`: a file each, large JSON-lines and text files at line or paragraph
breaks, parquet between row groups); in the scan a task per part reads it and returns, per document, what the
decisions need (`moe_core.data.parts.document_facts`: sha256, sizes, domain, MinHash band keys, and the part's
own sample candidates), and in pass 2 a task per part reads it again and tokenizes its kept documents. What
depends on the order of the stream stays in this process and takes the parts' results in part order, as the
local scan takes documents (`_OrderedScan`: exact duplicates keep their first copy, near-duplicate groups their
first member, domains are numbered as first seen, the samples are chosen), with packing and writing. The
shards are byte for byte the same for any ``num_proc`` and either engine; the local scan is the reference the
Ray scan is tested equal to (tests/test_data_ray.py).

Everything is written to ``.<out>.partial-<fingerprint>`` beside `out_dir` and renamed into place at the end,
so `out_dir` (a previous preparation included) is never seen half written. A preparation that is killed, or
stops on a full disk, leaves that directory with its checkpoints (after the scan, and after every shard):
running it again with the same inputs continues where it stopped and gives the same shards as an
uninterrupted run. Bad input (a malformed record is named by file and line or row group) stops the scan
before anything expensive, and leaves nothing behind. When `out_dir` already holds data prepared from the
same config and source (same fingerprint) it is verified against its checksums and reused.
"""

from __future__ import annotations

# Lazy: `datasets` and `transformers` (heavy, seconds) load inside the functions that tokenize; the flows
# and `moe-lab run --help-config` import this module for `PrepareConfig`.
import collections
import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from moe_core.data.encode import Encoder, encode_chunk, encode_in_worker, init_worker
from moe_core.data.errors import DataError
from moe_core.data.minhash import NearDuplicates
from moe_core.data.parts import (
    DocumentFacts,
    SampleBounds,
    document_facts,
    encode_part,
    hash_fraction,
    new_samples,
    sample_item,
    sample_keys,
    scan_part,
)
from moe_core.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    ShardWriter,
    read_manifest,
    sha256_file,
    verify_prepared,
)
from moe_core.data.sources import (
    DEFAULT_MAX_LINE_BYTES,
    KINDS,
    SourceSpec,
    parse_source,
    source_fingerprint,
)
from moe_core.data.stream import Partition, iter_documents, partition_source
from moe_core.data.tokenizer import load_tokenizer, tokenizer_hash, train_tokenizer
from moe_core.data.validation import ValidationConfig, ValidationResult, validate
from moe_core.fileio import (
    IN_USE,
    DiskFullError,
    clean_abandoned_temporaries,
    disk_full_guard,
    fsync_directory,
    fsync_tree,
    remove_abandoned,
    replace_path,
)
from moe_core.progress import Progress

SPLITS = ("train", "validation", "test")
DTYPES = ("auto", "uint16", "uint32")
CHUNK_BYTES = 1 << 20  # documents are tokenized in chunks of about this much text
CHUNK_DOCUMENTS = 4096
ENGINES = ("local", "ray")
IN_PROCESS_BYTES = 8 << 20  # less text than this is tokenized in this process whatever num_proc says
VALIDATION_SAMPLE_BYTES = 256 << 20  # the validation sample's size bound, beside its row bound
MB = 1e6


@dataclass
class PrepareConfig:
    """Everything that decides the prepared data (all of it except `num_proc` and `engine` enters the
    fingerprint)."""

    source: str = "builtin"  # "builtin", a local file/dir/glob, or a hub id (hf:owner/name)
    kind: str = "text"  # "text" or "instruction" (rendered with the chat template)
    text_column: str = "text"
    domain_column: str | None = (
        None  # a column of domain labels; default: the source's own ("text" for files)
    )
    hub_config: str | None = None  # e.g. "wikitext-103-raw-v1"
    split: str = "train"  # the hub split to read
    seq_len: int = 256  # tokens per packed block
    vocab_size: int = 8000  # of a newly trained tokenizer
    tokenizer: str | None = None  # None: train one; else a tokenizer directory or hub id
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    seed: int = 0  # validation sample
    max_documents: int | None = None  # None: every document
    num_proc: int = 1  # tokenizer processes (the shards are the same for any number)
    engine: str = "local"  # "local" (this process reads; num_proc tokenize) or "ray" (tasks read, scan and
    # tokenize the parts of the source); the same shards
    dtype: str = "auto"  # token dtype: uint16 when the vocabulary fits, else uint32
    blocks_per_shard: int = 8192
    dedup: bool = True
    validate: bool = True
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    txt_sample_by: str = (
        "paragraph"  # .txt documents: "paragraph" (blank-line separated), "line" or "document"
    )
    min_eval_bytes_per_block: int = 8  # see assign_splits
    tokenizer_sample_bytes: int = 32_000_000  # a new tokenizer is trained on this much train text at most
    validation_max_rows: int = 20_000  # rows the suite checks when validation.sample_rows is None
    near_dedup: float | None = None  # MinHash LSH near-duplicate removal at this Jaccard threshold
    minhash_num_perm: int = 128
    minhash_ngram: int = 5  # words per shingle

    def __post_init__(self) -> None:
        if isinstance(self.validation, dict):
            self.validation = ValidationConfig(**self.validation)

        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"PrepareConfig.{name}={getattr(self, name)!r}: {msg}")

        if self.kind not in ("text", "instruction"):
            raise bad(
                "kind",
                "prepare packs 'text' or 'instruction' data; preference pairs are read with "
                "moe_core.data.sources.load_source(..., kind='preference')",
            )
        for name in (
            "seq_len",
            "vocab_size",
            "num_proc",
            "blocks_per_shard",
            "max_line_bytes",
            "tokenizer_sample_bytes",
            "validation_max_rows",
            "minhash_num_perm",
            "minhash_ngram",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise bad(name, "must be a positive integer")
        if self.seq_len < 2:
            raise bad("seq_len", "must be >= 2")
        if self.max_documents is not None and self.max_documents <= 0:
            raise bad("max_documents", "must be positive, or None for all documents")
        for name in ("val_fraction", "test_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise bad(name, "must be in [0, 1)")
        if self.val_fraction + self.test_fraction >= 1.0:
            raise bad("test_fraction", "val_fraction + test_fraction must be < 1 (leave data to train on)")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose one of {DTYPES}")
        if self.txt_sample_by not in ("paragraph", "line", "document"):
            raise bad("txt_sample_by", "choose 'paragraph', 'line' or 'document'")
        if self.engine not in ENGINES:
            raise bad("engine", f"choose one of {ENGINES}")
        if self.engine == "ray" and importlib.util.find_spec("ray") is None:
            raise bad("engine", "needs Ray: pip install '.[ray]' (or engine='local')")
        if self.near_dedup is not None and not 0.0 < self.near_dedup < 1.0:
            raise bad("near_dedup", "a Jaccard threshold between 0 and 1 (e.g. 0.8), or None for off")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_fingerprint(config: PrepareConfig, source_fp: str, tokenizer_fp: str | None = None) -> str:
    data = config.to_dict()
    data.pop("num_proc")  # does not change the output
    data.pop("engine")
    blob = json.dumps(
        {"format": FORMAT_VERSION, "config": data, "source": source_fp, "tokenizer": tokenizer_fp},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _tokenizer_fingerprint(name: str | None) -> str | None:
    if name is None:
        return None
    path = Path(name)
    if path.is_dir():  # hash the files, so an edited tokenizer directory is noticed
        return hashlib.sha256(
            "".join(f"{p.name}:{sha256_file(p)}" for p in sorted(path.rglob("*")) if p.is_file()).encode()
        ).hexdigest()
    return f"hub:{name}"


def prepare(
    config: PrepareConfig,
    out_dir: str | Path,
    overwrite: bool = False,
    validated: ValidationResult | None = None,
) -> Path:
    """Prepare `config.source` into `out_dir` (see the module docstring); returns `out_dir`.

    ``validated``: the passed report of validating this source with ``config.kind`` and ``config.validation``
    just before (`validate_source`, as the lifecycle's validate stage does); it goes into the manifest instead
    of the documents being validated a second time. The prepared data and its fingerprint are the same.

    Reuses `out_dir` when it holds data from the same inputs (after checking its checksums). Raises
    `DataError` when `out_dir` holds something else and `overwrite` is False, and `DataError` /
    `DataValidationError` on bad input, leaving `out_dir` untouched."""
    out = Path(out_dir)
    spec = parse_source(config.source)
    source_fp = source_fingerprint(spec, config.hub_config, config.split)
    fingerprint = config_fingerprint(config, source_fp, _tokenizer_fingerprint(config.tokenizer))
    if (out / MANIFEST).is_file():
        try:
            same = read_manifest(out).get("fingerprint") == fingerprint
        except DataError:
            if not overwrite:
                raise
            same = False
        if same and not overwrite:
            verify_prepared(out)
            for left in out.parent.glob(f".{out.name}.partial-*"):  # a killed run's, now superseded
                remove_abandoned(left)
            return out
        if not same and not overwrite:
            raise DataError(
                f"{out}: holds data prepared from other inputs (config or source changed); pass "
                "overwrite=True (--overwrite) to replace it, or choose another directory"
            )
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise DataError(
            f"{out}: exists and is not a prepared-data directory; choose an empty or new directory"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_abandoned_temporaries(out)
    work = out.parent / f".{out.name}.partial-{fingerprint[:16]}"
    for other in out.parent.glob(f".{out.name}.partial-*"):  # left by a preparation of other inputs
        if other != work and other.is_dir():
            remove_abandoned(other)
    with _claimed(work, out):
        try:
            _build(config, work, fingerprint, source_fp, spec, validated)
        except DataError:  # bad input or config: nothing expensive was done, and a rerun would redo it
            shutil.rmtree(work, ignore_errors=True)
            raise
        except DiskFullError as err:
            raise DiskFullError(
                f"{err}. The work done so far stays in {work} and the same command continues from it; "
                f"{out} is untouched"
            ) from None
        for name in os.listdir(work):  # checkpoints: not part of the prepared data
            if name.startswith(("scan.", "progress.", "pending-")):
                os.unlink(work / name)
        with disk_full_guard(work):
            fsync_tree(work)
            replace_path(work, out)
    os.unlink(out / IN_USE)
    fsync_directory(out)
    fsync_directory(out.parent)
    return out


class _claimed:
    """Create (or take over) the work directory and hold its ``.in-use`` flock while preparing; a second
    process preparing the same output at the same time is refused."""

    def __init__(self, work: Path, out: Path) -> None:
        self.work, self.out = work, out

    def __enter__(self) -> Path:
        self.work.mkdir(exist_ok=True)
        self.fd = os.open(self.work / IN_USE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self.fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise DataError(
                f"{self.out}: another process is preparing it right now ({self.work}); wait for it to finish"
            ) from None
        return self.work

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------------------------------------- splits
def _initial_splits(config: PrepareConfig, u_N: np.ndarray) -> np.ndarray:
    """Split id (0 train, 1 validation, 2 test) from u in [0, 1), the document's hash as a fraction."""
    split_N = np.zeros(len(u_N), dtype=np.int8)
    split_N[u_N < config.test_fraction + config.val_fraction] = 1
    split_N[u_N < config.test_fraction] = 2
    return split_N


def _fill_eval_splits(
    config: PrepareConfig, split_N: np.ndarray, u_N: np.ndarray, chars_N: np.ndarray
) -> dict[str, int]:
    """Small corpora still get evaluation blocks: a validation/test split with fewer than
    ``min_eval_bytes_per_block * seq_len`` characters takes the train documents nearest to its boundary (by u)
    until it has them, as long as train keeps more than half of the documents. Changes ``split_N`` in place."""
    counts = {}
    need = config.min_eval_bytes_per_block * config.seq_len
    for sid, fraction in ((1, config.val_fraction), (2, config.test_fraction)):
        if fraction <= 0:
            continue
        have = int(chars_N[split_N == sid].sum())
        boundary = config.test_fraction if sid == 2 else config.test_fraction + config.val_fraction
        train = np.flatnonzero(split_N == 0)
        n_docs, n_train = int((split_N >= 0).sum()), len(train)
        moved = 0
        if have < need:
            nearest = train[np.argsort(np.abs(u_N[train] - boundary), kind="stable")]
            for i in nearest:
                if have >= need or (n_train - moved - 1) * 2 <= n_docs:
                    break
                split_N[i] = sid
                have += int(chars_N[i])
                moved += 1
        counts[f"moved_to_{SPLITS[sid]}"] = moved
    return counts


def assign_splits(config: PrepareConfig, texts: list[str]) -> tuple[list[int], dict[str, int]]:
    """Split id per document (0 train, 1 validation, 2 test, -1 duplicate removed) from its sha256, and
    exact-duplicate removal; what the streaming scan (`_scan`) decides, for a list of texts.

    A document goes to test when u < test_fraction, to validation when u < test + val fractions, where
    u in [0, 1) is its hash; then `_fill_eval_splits`."""
    digests = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in texts]
    u_N = np.asarray([hash_fraction(d) for d in digests], dtype=np.float64)
    split_N = _initial_splits(config, u_N)
    seen: set[bytes] = set()
    duplicates = 0
    for i, d in enumerate(digests):
        if d in seen:
            duplicates += 1
            if config.dedup:
                split_N[i] = -1
        seen.add(d)
    counts = {"duplicates_removed": duplicates if config.dedup else 0}
    counts.update(_fill_eval_splits(config, split_N, u_N, np.asarray([len(t) for t in texts])))
    return split_N.tolist(), counts


# ---------------------------------------------------------------------------------------------- build
def _read_args(config: PrepareConfig) -> dict[str, Any]:
    """How `iter_documents` reads the source for this config (in this process, or a part in a worker)."""
    return dict(
        kind=config.kind,
        text_column=config.text_column,
        domain_column=config.domain_column,
        hub_config=config.hub_config,
        split=config.split,
        txt_sample_by=config.txt_sample_by,
        max_line_bytes=config.max_line_bytes,
        max_documents=config.max_documents,
    )


def _documents(config: PrepareConfig, spec: SourceSpec, check: bool = True):
    return iter_documents(spec, check=check, **_read_args(config))


def _source_bytes(spec: SourceSpec) -> int | None:
    return sum(p.stat().st_size for p in spec.files) if spec.type == "local" else None


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _build(
    config: PrepareConfig,
    work: Path,
    fingerprint: str,
    source_fp: str,
    spec: SourceSpec,
    validated: ValidationResult | None,
) -> None:
    with Progress(3, "prepare data", unit="stage") as bar:
        bar.stage("scan")
        if (work / "scan.json").is_file():
            scan = json.loads((work / "scan.json").read_text())
            arrays = np.load(work / "scan.npz")
            split_N, domain_N = arrays["split"], arrays["domain"]
            print(f"prepare: resuming {work} (scan and tokenizer done)", file=sys.stderr, flush=True)
        else:
            scan, split_N, domain_N = _scan_and_tokenizer(config, work, spec, validated)
        tokenizer = load_tokenizer(work / "tokenizer")
        bar.stage("tokenize")
        splits = _tokenize_and_pack(config, work, scan, split_N, domain_N, tokenizer, spec)
        bar.stage("manifest")
        if splits["train"]["num_blocks"] == 0:
            raise DataError(
                f"{spec.name}: the train split has {splits['train']['tokens_total']} tokens, fewer than "
                f"one block of seq_len={config.seq_len}; use more documents or a shorter seq_len"
            )
        for entry in splits.values():
            entry.pop("tokens_total")
        tok_dir = work / "tokenizer"
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "source": {"name": spec.name, "type": spec.type, "fingerprint": source_fp},
            "config": config.to_dict(),
            "seq_len": config.seq_len,
            "dtype": scan["dtype"],
            "domains": scan["domains"],
            "tokenizer": {
                "hash": tokenizer_hash(tokenizer),
                "origin": config.tokenizer or "trained",
                "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
                "bos_token_id": tokenizer.bos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
                "files": {p.name: sha256_file(p) for p in sorted(tok_dir.iterdir()) if p.is_file()},
                "sample": scan["tokenizer_sample"],
            },
            "counts": scan["counts"],
            "near_dedup": scan["near_dedup"],
            "splits": splits,
            "validation": scan["validation"],
            "versions": {"python": platform.python_version(), **_versions()},
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
        bar.advance_to(3)


def _scan_and_tokenizer(
    config: PrepareConfig, work: Path, spec: SourceSpec, validated: ValidationResult | None
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Pass 1 over the source (see the module docstring), the validation suite, the splits, the tokenizer;
    checkpointed as ``scan.json`` + ``scan.npz`` + ``tokenizer/``. Per document it keeps a few bytes."""
    if validated is not None:
        validated.raise_for_failure()  # a failed report is never recorded as a passed preparation
    val_rows = config.validation.sample_rows or config.validation_max_rows
    bounds = SampleBounds(
        validation=(val_rows, VALIDATION_SAMPLE_BYTES) if config.validate and validated is None else None,
        tokenizer=config.tokenizer_sample_bytes if config.tokenizer is None else None,
        rate=1 << 20,  # kept documents, to measure tokens per character
        eval_fraction=config.test_fraction + config.val_fraction,
        instruction=config.kind == "instruction",
    )
    ordered = _OrderedScan(config, spec, bounds)
    total = _source_bytes(spec)
    with Progress(total / MB if total else None, "prepare: scan", unit="MB") as bar:
        if config.engine == "ray":
            parts = _ray_scan(config, spec, ordered, bounds, bar)
        else:  # the reference: every document read and its facts computed here, in stream order
            parts = None
            for doc in _documents(config, spec):
                bar.update(len(doc.text) / MB)
                facts = document_facts(doc, ordered.near, ordered.seen)
                ordered.add(facts, sample_item(doc, bounds), doc.text, doc.text)
    u, chars, status, domain = ordered.u, ordered.chars, ordered.status, ordered.domain
    domain_index, near = ordered.domain_index, ordered.near
    if not len(u):
        raise DataError(f"{spec.name}: every document is empty; nothing to prepare")
    val_sample, tok_sample, rate_sample = ordered.samples(config, spec, parts)
    loaded, empty = ordered.loaded, ordered.empty
    duplicates, near_duplicates = ordered.duplicates, ordered.near_duplicates
    tok_bytes = ordered.tok.bytes if ordered.tok is not None else 0
    del ordered

    report = validated
    if val_sample is not None:
        sample = val_sample
        report = validate(
            [record for _, record in sample],
            config.kind,
            config.validation,
            source=spec.name,
            positions=[i for i, _ in sample],
            rows_total=len(u),
        )
        report.raise_for_failure()
        del val_sample, sample
    if report is not None:
        (work / "validation.md").write_text(report.to_markdown())
        (work / "validation.json").write_text(json.dumps(report.to_dict(), indent=1))

    u_N = np.frombuffer(u, dtype=np.float64)
    status_N = np.frombuffer(status, dtype=np.int8)
    split_N = _initial_splits(config, u_N)
    if config.dedup:
        split_N[status_N == 1] = -1
    split_N[status_N == 2] = -1
    counts = {
        "documents_loaded": loaded,
        "dropped_empty": empty,
        "duplicates_removed": duplicates if config.dedup else 0,
        "near_duplicates_removed": near_duplicates,
    }
    counts.update(_fill_eval_splits(config, split_N, u_N, np.frombuffer(chars, dtype=np.int64)))
    counts["documents_kept"] = int((split_N >= 0).sum())
    names = sorted(domain_index)
    remap = np.asarray([names.index(d) for d in domain_index], dtype=np.uint8)
    domain_N = remap[np.frombuffer(domain, dtype=np.uint8)]

    if tok_sample is not None:
        texts = [t for i, t in tok_sample if split_N[i] == 0]
        sample_info = {
            "documents": len(texts),
            "bytes": tok_bytes,
            "max_bytes": config.tokenizer_sample_bytes,
        }
        tokenizer = train_tokenizer(texts, config.vocab_size)
    else:
        tokenizer = load_tokenizer(config.tokenizer)
        sample_info = None
    staged = work / "tokenizer.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    tokenizer.save_pretrained(str(staged))
    shutil.rmtree(work / "tokenizer", ignore_errors=True)
    os.replace(staged, work / "tokenizer")
    vocab = len(tokenizer)
    dtype = config.dtype if config.dtype != "auto" else ("uint16" if vocab <= 2**16 else "uint32")
    if dtype == "uint16" and vocab > 2**16:
        raise DataError(
            f"dtype uint16 cannot hold token ids of a {vocab}-token vocabulary; use uint32 or auto"
        )
    kept_chars = int(np.frombuffer(chars, dtype=np.int64)[split_N >= 0].sum())
    measured = [t for _, t in rate_sample]
    n_tokens = sum(len(ids) + 1 for ids in tokenizer(measured, add_special_tokens=False)["input_ids"])
    scan = {
        "counts": counts,
        "domains": names,
        "dtype": dtype,
        "kept_chars": kept_chars,
        "tokens_per_char": n_tokens / max(1, sum(len(t) for t in measured)),
        "tokenizer_sample": sample_info,
        "near_dedup": near.describe() if near is not None else None,
        "partitions": parts,  # engine="ray": the parts read and their documents, for pass 2
        "validation": None
        if report is None
        else {"suite": report.suite, "success": report.success, "rows_checked": report.rows_checked},
    }
    tmp = work / "scan.tmp.npz"
    np.savez(tmp, split=split_N, domain=domain_N)
    os.replace(tmp, work / "scan.npz")
    _write_json(work / "scan.json", scan)  # last: its presence says the scan is complete
    return scan, split_N, domain_N


class _OrderedScan:
    """The scan's decisions that depend on the order of the stream, taken one document at a time in stream
    order, whichever engine computed the documents' facts (`document_facts`): an exact duplicate (same
    sha256) keeps its first copy, a near-duplicate (an LSH band shared with an earlier document) its group's
    first member, domains are numbered as first seen; and the three bounded samples. A few bytes per
    document: u (the split), characters, state, domain id."""

    def __init__(self, config: PrepareConfig, spec: SourceSpec, bounds: SampleBounds) -> None:
        self.spec, self.bounds = spec, bounds
        self.u, self.chars, self.status, self.domain = array("d"), array("q"), array("b"), array("B")
        self.domain_index: dict[str, int] = {}
        self.seen: set[bytes] = set()  # the first 16 bytes of every digest so far
        self.near = (
            NearDuplicates(config.near_dedup, config.minhash_num_perm, config.minhash_ngram)
            if config.near_dedup is not None
            else None
        )
        self.val, self.tok, self.rate = new_samples(bounds)
        self.loaded = self.empty = self.duplicates = self.near_duplicates = 0

    def add(self, facts: DocumentFacts | None, val_item: Any, tok_text: str | None, rate_text: str | None):
        """One record of the stream; a sample's item may be None when the engine did not send it (read again
        from its part in `samples` if the sample keeps it)."""
        self.loaded += 1
        if facts is None:
            self.empty += 1
            return
        digest, i = facts.digest, len(self.u)
        # 0 keep, 1 exact duplicate, 2 near-duplicate (removed only when dedup / near_dedup say so)
        state = 1 if digest[:16] in self.seen else 0
        self.seen.add(digest[:16])
        if state == 1:
            self.duplicates += 1
        elif self.near is not None and self.near.add_keys(facts.band_keys):
            state = 2
            self.near_duplicates += 1
        if len(self.domain_index) == 255 and facts.domain not in self.domain_index:
            raise DataError(f"{self.spec.name}: over 255 domains; at most 255 fit the uint8 domain ids")
        u = hash_fraction(digest)
        self.u.append(u)
        self.chars.append(facts.chars)
        self.status.append(state)
        self.domain.append(self.domain_index.setdefault(facts.domain, len(self.domain_index)))
        k_val, k_tok, k_rate = sample_keys(digest)
        if self.val is not None:
            self.val.add(k_val, i, facts.nbytes, val_item)
        # a train document (moves to evaluation splits are undone later)
        if self.tok is not None and state == 0 and u >= self.bounds.eval_fraction:
            self.tok.add(k_tok, i, facts.nbytes, tok_text)
        if state == 0:
            self.rate.add(k_rate, i, facts.nbytes, rate_text)

    def samples(self, config: PrepareConfig, spec: SourceSpec, parts: list[dict[str, Any]] | None):
        """(index, item) lists of the validation, tokenizer and rate samples (None when not kept), in stream
        order; items a part did not send are read from it again here (a duplicate from an earlier part
        crowded them out of the part's own sample: rare, and only those parts)."""
        out = [s.items() if s is not None else None for s in (self.val, self.tok, self.rate)]
        missing = sorted({i for items in out if items for i, item in items if item is None})
        if missing:
            found = _read_documents(config, spec, parts or [], missing)
            for k, items in enumerate(out):
                if items:
                    out[k] = [
                        (i, item if item is not None else _as_item(found[i], k, self.bounds))
                        for i, item in items
                    ]
        return out


def _as_item(doc, k: int, bounds: SampleBounds) -> Any:
    return sample_item(doc, bounds) if k == 0 else doc.text


def _read_documents(config: PrepareConfig, spec: SourceSpec, parts: list[dict[str, Any]], wanted: list[int]):
    """The documents of the given (non-blank, global) indexes, read from the parts that hold them."""
    found, wanted_set, first = {}, set(wanted), 0
    for entry in parts:
        last = first + entry["documents"]
        if wanted_set.intersection(range(first, last)):
            i = first
            for doc in iter_documents(spec, part=_partition(entry), check=False, **_read_args(config)):
                if i >= last:
                    break
                if doc.text.strip():
                    if i in wanted_set:
                        found[i] = doc
                    i += 1
        first = last
    return found


def _partition(entry: dict[str, Any]) -> Partition:
    return Partition(None if entry["path"] is None else Path(entry["path"]), entry["start"], entry["stop"])


def _ray_scan(
    config: PrepareConfig, spec: SourceSpec, ordered: _OrderedScan, bounds: SampleBounds, bar: Progress
) -> list[dict[str, Any]]:
    """Pass 1 on Ray: a task per part of the source (`partition_source`) reads it and computes its documents'
    facts (`scan_part`); the results are taken in part order into ``ordered``, which decides as the local scan
    does. Returns the parts read with their non-blank documents (all of them unless ``max_documents`` ends
    the stream inside the part), for pass 2."""
    parts = partition_source(spec, txt_sample_by=config.txt_sample_by)
    read = _read_args(config)
    near_args = (
        (config.near_dedup, config.minhash_num_perm, config.minhash_ngram) if config.near_dedup else None
    )
    limit = config.max_documents
    done: list[dict[str, Any]] = []
    with _ray_session(config.num_proc) as ray:
        task = ray.remote(num_cpus=1)(scan_part)
        calls = ((part, lambda p=part: task.remote(spec, p, read, near_args, bounds)) for part in parts)
        for part, result in _in_order(ray, calls):
            left = None if limit is None else limit - ordered.loaded
            facts = result.facts if left is None else result.facts[:left]
            j = 0  # non-blank documents of the part so far
            for f in facts:
                if f is None:
                    ordered.add(None, None, None, None)
                    continue
                ordered.add(f, result.validation.get(j), result.tokenizer.get(j), result.rate.get(j))
                bar.update(f.chars / MB)
                j += 1
            whole = len(facts) == len(result.facts)
            if result.error is not None and whole:
                raise DataError(result.error)
            done.append(
                {
                    "path": None if part.path is None else str(part.path),
                    "start": part.start,
                    "stop": part.stop,
                    "documents": j,
                    "whole": whole and not (limit is not None and ordered.loaded >= limit),
                }
            )
            if limit is not None and ordered.loaded >= limit:
                break
    return done


def _in_order(ray: Any, calls):
    """(key, result) of each (key, submit) in order, with at most two tasks per cluster CPU in flight (bounded
    memory). When the caller stops early (a bad record, a full disk, ``max_documents`` reached) the tasks still
    in flight are waited for and their results dropped, not cancelled: in Ray 2.60 ``ray.cancel`` races a
    task's completion and can abort this whole process ("Check failed: it != submissible_tasks_.end() Tried to
    complete task that was not pending", task_manager.cc; ray-project/ray#54846), seen here in a pytest worker
    running these tests, and the likely cause of a CI worker's death. At most that many parts are read to no
    use. A task's `DataError` is raised as itself (its message names the file and line), not inside Ray's
    traceback."""
    limit = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    in_flight: collections.deque = collections.deque()

    def get(ref):
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, DataError):
                raise DataError(str(err.cause)) from None
            raise

    try:
        for key, submit in calls:
            in_flight.append((key, submit()))
            while len(in_flight) >= limit:
                key_, ref = in_flight.popleft()
                yield key_, get(ref)
        while in_flight:
            key_, ref = in_flight.popleft()
            yield key_, get(ref)
    finally:
        if in_flight:
            refs = [ref for _, ref in in_flight]
            ray.wait(refs, num_returns=len(refs), fetch_local=False)


class _ray_session:
    """The Ray cluster ``RAY_ADDRESS`` names, one this process has already joined, or a local one started
    here (``num_proc`` CPUs when more than 1) and shut down at the end."""

    def __init__(self, num_proc: int) -> None:
        self.num_proc, self.started = num_proc, False

    def __enter__(self):
        import ray  # optional: pip install '.[ray]' (PrepareConfig checks it is there)

        if not ray.is_initialized():
            local = (
                {}
                if os.environ.get("RAY_ADDRESS")
                else {"num_cpus": self.num_proc if self.num_proc > 1 else None}
            )
            ray.init(**local, include_dashboard=False, log_to_driver=False)
            self.started = True
        self.ray = ray
        return ray

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.ray.shutdown()


def _chunks(config: PrepareConfig, spec: SourceSpec, split_N: np.ndarray, domain_N: np.ndarray, start: int):
    """(end, texts, split ids, domain ids, chars) of consecutive kept documents from document ``start`` on;
    ``end`` is the index of the first document after the chunk (where a restart continues)."""
    texts: list[str] = []
    sids: list[int] = []
    doms: list[int] = []
    size = 0
    i = -1
    for doc in _documents(config, spec, check=False):  # the scan checked the files
        if not doc.text.strip():
            continue
        i += 1
        if i < start or split_N[i] < 0:
            continue
        texts.append(doc.text)
        sids.append(int(split_N[i]))
        doms.append(int(domain_N[i]))
        size += len(doc.text)
        if size >= CHUNK_BYTES or len(texts) >= CHUNK_DOCUMENTS:
            yield i + 1, texts, sids, doms, size
            texts, sids, doms, size = [], [], [], 0
    if i + 1 != len(split_N):
        raise DataError(
            f"{spec.name}: changed while it was being prepared ({i + 1} documents now, {len(split_N)} in the "
            "scan); prepare it again with --overwrite once it stops changing"
        )
    yield len(split_N), texts, sids, doms, size


def _tokenize_and_pack(
    config: PrepareConfig,
    work: Path,
    scan: dict[str, Any],
    split_N: np.ndarray,
    domain_N: np.ndarray,
    tokenizer: Any,
    spec: SourceSpec,
) -> dict[str, dict[str, Any]]:
    """Pass 2: tokenize chunks (here or in ``num_proc`` workers, results taken in order) into one
    `ShardWriter` per split; a checkpoint after every chunk that completed a shard."""
    dtype = scan["dtype"]
    layout = (config.seq_len, dtype, config.blocks_per_shard)
    progress_file = work / "progress.json"
    start = 0
    documents = dict.fromkeys(SPLITS, 0)
    if progress_file.is_file():
        saved = json.loads(progress_file.read_text())
        pending = np.load(work / saved["pending"])
        writers = {
            name: ShardWriter.from_state(
                work,
                name,
                *layout,
                saved["writers"][name],
                pending[f"{name}_tokens"],
                pending[f"{name}_domains"],
            )
            for name in SPLITS
        }
        start, documents = saved["documents_done"], saved["documents"]
        print(f"prepare: resuming {work} at document {start} of {len(split_N)}", file=sys.stderr, flush=True)
    else:
        writers = {name: ShardWriter(work, name, *layout) for name in SPLITS}
    checkpoints = [0]

    def checkpoint(done: int) -> None:
        checkpoints[0] += 1
        states, arrays = {}, {}
        for name, writer in writers.items():
            states[name], arrays[f"{name}_tokens"], arrays[f"{name}_domains"] = writer.state()
        pending_name = f"pending-{checkpoints[0]}-{os.getpid()}.npz"
        np.savez(work / pending_name, **arrays)
        previous = json.loads(progress_file.read_text())["pending"] if progress_file.is_file() else None
        _write_json(
            progress_file,
            {"documents_done": done, "documents": documents, "writers": states, "pending": pending_name},
        )
        if previous and previous != pending_name:
            (work / previous).unlink(missing_ok=True)

    itemsize = np.dtype(dtype).itemsize + 1  # token + domain id
    needed = _bytes_needed(scan, itemsize, split_N, start)
    backend = tokenizer.backend_tokenizer.to_str()
    append_eos = config.kind == "text"  # rendered chats already end each turn with EOS
    workers = config.num_proc if config.num_proc > 1 and scan["kept_chars"] > IN_PROCESS_BYTES else 0
    tok = (backend, tokenizer.eos_token_id, append_eos)
    if config.engine == "ray" and scan.get("partitions") is not None:  # the workers read their parts
        pool = _ray_part_encoder(config, spec, scan["partitions"], split_N, domain_N, start, *tok)
        chunks = None
    else:  # this process reads (a scan by the local engine resumed on Ray too)
        chunks = _chunks(config, spec, split_N, domain_N, start)
        pool = _ray_encoder(config.num_proc, *tok) if config.engine == "ray" else _encoder_pool(workers, *tok)
    with (
        disk_full_guard(work, needed),
        Progress(scan["kept_chars"] / MB, "prepare: tokenize", unit="MB") as bar,
        pool as encode,
    ):
        for end, results, size in encode(chunks):
            shards = 0
            for name, (tokens, domains, n_docs) in zip(SPLITS, results):
                shards += writers[name].append(tokens, domains)
                documents[name] += n_docs
            bar.update(size / MB)
            if shards:
                checkpoint(end)
        out = {}
        for name, writer in writers.items():
            out[name] = {"documents": documents[name], **writer.finish(), "tokens_total": writer.total_tokens}
    return out


def _bytes_needed(scan: dict[str, Any], itemsize: int, split_N: np.ndarray, start: int) -> int:
    """About how many bytes the shards still need: the kept text not yet tokenized times the tokens per
    character measured on a sample in the scan, times bytes per token (ids + domain ids), plus 10%."""
    left = scan["kept_chars"] * (1 - start / max(len(split_N), 1))
    return int(left * scan["tokens_per_char"] * itemsize * 1.1) + (1 << 20)


class _encoder_pool:
    """A function mapping chunks to (end, per-split results, size) in chunk order: in this process
    (``workers=0``: ``num_proc=1``, or too little text to start processes for) or in a spawned pool with at
    most two chunks per worker in flight (bounded memory)."""

    def __init__(self, workers: int, backend: str, eos: int, append_eos: bool) -> None:
        self.workers, self.args = workers, (backend, eos, append_eos)
        self.pool = None

    def __enter__(self):
        if self.workers:
            self.pool = multiprocessing.get_context("spawn").Pool(
                self.workers, initializer=init_worker, initargs=self.args
            )
        return self.run

    def run(self, chunks):
        if self.pool is None:  # one process, one core: documents encoded one by one, not on a thread pool
            encoder = Encoder(*self.args, batch=False)
            for end, texts, sids, doms, size in chunks:
                yield end, encoder.encode(texts, sids, doms), size
            return
        in_flight: collections.deque = collections.deque()
        for end, texts, sids, doms, size in chunks:
            in_flight.append((end, self.pool.apply_async(encode_in_worker, (texts, sids, doms)), size))
            while len(in_flight) >= 2 * self.workers:
                end_, result, size_ = in_flight.popleft()
                yield end_, result.get(), size_
        while in_flight:
            end_, result, size_ = in_flight.popleft()
            yield end_, result.get(), size_

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


class _ray_part_encoder:
    """Pass 2 on Ray: a task per part of the scan (`encode_part`) reads its documents itself and tokenizes the
    kept ones with the split and domain ids sent to it; (end, per-split results, characters) in part order,
    ``end`` the index of the first document after the part (where a restart continues). Parts before
    ``start`` (done before a resume) are skipped, a part it falls in is read from there."""

    def __init__(self, config, spec, parts, split_N, domain_N, start, backend, eos, append_eos) -> None:
        self.config, self.spec, self.parts = config, spec, parts
        self.split_N, self.domain_N, self.start = split_N, domain_N, start
        self.tokenizer = (backend, eos, append_eos)

    def __enter__(self):
        self.session = _ray_session(self.config.num_proc)
        self.ray = self.session.__enter__()
        return self.run

    def run(self, _chunks: None = None):
        ray, read = self.ray, _read_args(self.config)
        task = ray.remote(num_cpus=1)(encode_part)
        backend, eos, append_eos = self.tokenizer
        backend_ref = ray.put(backend)
        calls, first = [], 0
        for entry in self.parts:
            last = first + entry["documents"]
            if last > self.start:
                skip = max(0, self.start - first)
                sids, doms = self.split_N[first + skip : last], self.domain_N[first + skip : last]
                args = (self.spec, _partition(entry), read, skip, sids, doms, backend_ref, eos, append_eos)
                calls.append((last, lambda a=args, w=entry["whole"]: task.remote(*a, whole=w)))
            first = last
        if first != len(self.split_N):
            raise DataError(
                f"{self.spec.name}: the scan's parts hold {first} documents, not {len(self.split_N)}"
            )
        for end, (results, chars) in _in_order(ray, calls):
            yield end, results, chars

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__(*exc)


class _ray_encoder:
    """`_encoder_pool` on a Ray cluster: each chunk a Ray task (the tokenizer's JSON sent once through the object
    store, one encoder kept per worker process), at most two tasks per cluster CPU in flight (bounded memory),
    results taken in chunk order. Joins the cluster ``RAY_ADDRESS`` names, or starts a local one (``num_proc``
    CPUs when more than 1) and shuts it down at the end."""

    def __init__(self, num_proc: int, backend: str, eos: int, append_eos: bool) -> None:
        self.num_proc, self.backend, self.eos, self.append_eos = num_proc, backend, eos, append_eos

    def __enter__(self):
        self.session = _ray_session(self.num_proc)
        self.ray = ray = self.session.__enter__()
        self.task = ray.remote(num_cpus=1)(encode_chunk)
        self.tokenizer_ref = ray.put(self.backend)
        return self.run

    def run(self, chunks):
        calls = (
            (
                (end, size),
                lambda t=texts, s=sids, d=doms: self.task.remote(
                    self.tokenizer_ref, self.eos, self.append_eos, t, s, d
                ),
            )
            for end, texts, sids, doms, size in chunks
        )
        for (end, size), results in _in_order(self.ray, calls):
            yield end, results, size

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__(*exc)


def _versions() -> dict[str, str]:
    import datasets
    import transformers

    return {
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }


__all__ = ["KINDS", "SPLITS", "PrepareConfig", "assign_splits", "config_fingerprint", "prepare"]
