"""Prepare a source for training: load -> validate -> split -> dedup -> tokenizer -> tokenize -> pack -> shards.

    from moe_core.data.prepare import PrepareConfig, prepare
    data_dir = prepare(PrepareConfig(source="builtin", max_documents=200, vocab_size=2000), "runs/data")

Steps, in order (each count lands in the manifest):
  1. load the source (`moe_core.data.sources.load_source`); whitespace-only documents are dropped
     (blank lines separate paragraphs in line-based corpora such as WikiText);
  2. validate with the kind's great-expectations suite; a failure raises `DataValidationError` before any
     tokenizer is trained or anything is written;
  3. split train/validation/test by document hash (sha256 of the text; independent of the seed and of the
     order of the source), then drop exact duplicates (same hash, first kept);
  4. train a byte-level BPE tokenizer on the train split, or load ``config.tokenizer``;
  5. tokenize with ``datasets.map`` (batched, ``num_proc`` processes), documents joined by EOS;
  6. pack each split into [blocks, seq_len] shards (uint16 when the vocabulary fits, else uint32) with a
     parallel uint8 array of domain ids per token.

Everything is written to a temporary directory beside `out_dir` and renamed into place, so a failure leaves
no partial output. When `out_dir` already holds data prepared from the same config and source (same
fingerprint) it is verified against its checksums and reused.
"""

from __future__ import annotations

# Lazy: `datasets` and `transformers` (heavy, seconds) load inside the functions that tokenize; the flows
# and `moe-lab run --help-config` import this module for `PrepareConfig`.
import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from moe_core.data.errors import DataError
from moe_core.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    read_manifest,
    sha256_file,
    verify_prepared,
    write_split_shards,
)
from moe_core.data.sources import (
    DEFAULT_MAX_LINE_BYTES,
    KINDS,
    LoadedSource,
    load_source,
    parse_source,
    quiet_datasets,
    source_fingerprint,
    to_messages,
)
from moe_core.data.tokenizer import load_tokenizer, render_chat, tokenizer_hash, train_tokenizer
from moe_core.data.validation import ValidationConfig, ValidationResult, validate
from moe_core.fileio import atomic_directory
from moe_core.progress import Progress

SPLITS = ("train", "validation", "test")
DTYPES = ("auto", "uint16", "uint32")


@dataclass
class PrepareConfig:
    """Everything that decides the prepared data (all of it except `num_proc` enters the fingerprint)."""

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
    num_proc: int = 1  # processes for datasets.map
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
        for name in ("seq_len", "vocab_size", "num_proc", "blocks_per_shard", "max_line_bytes"):
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_fingerprint(config: PrepareConfig, source_fp: str, tokenizer_fp: str | None = None) -> str:
    data = config.to_dict()
    data.pop("num_proc")  # does not change the output
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

    with atomic_directory(out, overwrite=True, error_cls=DataError) as tmp:  # refusals were decided above
        _build(config, tmp, fingerprint, source_fp, validated)
    return out


# ---------------------------------------------------------------------------------------------- steps
def _documents(config: PrepareConfig, loaded: LoadedSource) -> tuple[list[str], list[str], dict[str, int]]:
    """Texts and domain labels of the loaded source (instruction records rendered with the chat template)."""
    ds = loaded.dataset
    counts = {"documents_loaded": len(ds)}
    if config.kind == "instruction":
        rows = ds.to_list()
        texts = [render_chat(to_messages(r)) for r in rows]
        domains = ["instruction"] * len(texts)
    else:
        texts, domains = list(ds["text"]), list(ds["domain"])
    keep = [i for i, t in enumerate(texts) if t is not None and t.strip()]
    counts["dropped_empty"] = len(texts) - len(keep)
    return [texts[i] for i in keep], [domains[i] for i in keep], counts


def assign_splits(config: PrepareConfig, texts: list[str]) -> tuple[list[int], dict[str, int]]:
    """Split id per document (0 train, 1 validation, 2 test) from its sha256, and exact-duplicate removal.

    A document goes to test when u < test_fraction, to validation when u < test + val fractions, where
    u in [0, 1) is its hash. So that small corpora still have evaluation blocks, a validation/test split
    with fewer than ``min_eval_bytes_per_block * seq_len`` bytes takes the train documents nearest to its
    boundary (by u) until it has them, as long as train keeps more than half of the documents."""
    digests = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in texts]
    u = [int.from_bytes(d[:8], "big") / 2**64 for d in digests]
    split = [
        2 if x < config.test_fraction else 1 if x < config.test_fraction + config.val_fraction else 0
        for x in u
    ]
    seen: set[bytes] = set()
    for i, d in enumerate(digests):
        if d in seen:
            split[i] = -1  # duplicate
        seen.add(d)
    counts = {"duplicates_removed": split.count(-1) if config.dedup else 0}
    if not config.dedup:  # keep duplicates in the split of their first copy (same hash, same split)
        first = {}
        for i, d in enumerate(digests):
            first.setdefault(d, i)
        split = [split[first[d]] for d in digests]
    need = config.min_eval_bytes_per_block * config.seq_len
    for sid, fraction in ((1, config.val_fraction), (2, config.test_fraction)):
        if fraction <= 0:
            continue
        have = sum(len(texts[i]) for i, s in enumerate(split) if s == sid)
        boundary = config.test_fraction if sid == 2 else config.test_fraction + config.val_fraction
        train = sorted((i for i, s in enumerate(split) if s == 0), key=lambda i: abs(u[i] - boundary))
        moved = 0
        n_docs = sum(1 for s in split if s >= 0)
        while have < need and train and (split.count(0) - 1) * 2 > n_docs:
            i = train.pop(0)
            split[i] = sid
            have += len(texts[i])
            moved += 1
        counts[f"moved_to_{SPLITS[sid]}"] = moved
    return split, counts


def tokenize_documents(
    config: PrepareConfig, tokenizer: Any, texts: list[str], domain_ids: list[int], split_ids: list[int]
) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """Per split: (tokens 1-D int64, domain id per token uint8, documents), documents joined by EOS."""
    import datasets

    order = sorted((i for i, s in enumerate(split_ids) if s >= 0), key=lambda i: split_ids[i])  # stable
    ds = datasets.Dataset.from_dict({"text": [texts[i] for i in order]})
    eos = tokenizer.eos_token_id
    append_eos = config.kind == "text"  # rendered chats already end each turn with EOS

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids] if append_eos else ids}

    if config.num_proc > 1:  # worker processes: keep the Rust tokenizer single-threaded in each
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with quiet_datasets():
        ds = ds.map(
            encode,
            batched=True,
            batch_size=256,
            num_proc=config.num_proc if config.num_proc > 1 else None,
            remove_columns=["text"],
            desc="tokenize",
        )
    column = ds.data.column("input_ids").combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    lengths = np.diff(offsets)
    doms = np.repeat(np.asarray([domain_ids[i] for i in order], dtype=np.uint8), lengths)
    out = {}
    sid = np.asarray([split_ids[i] for i in order])
    for k, name in enumerate(SPLITS):
        docs = np.flatnonzero(sid == k)
        if len(docs) == 0:
            out[name] = (np.zeros(0, np.int64), np.zeros(0, np.uint8), 0)
            continue
        a, b = offsets[docs[0]], offsets[docs[-1] + 1]
        out[name] = (values[a:b], doms[a:b], len(docs))
    return out


def _build(
    config: PrepareConfig, tmp: Path, fingerprint: str, source_fp: str, validated: ValidationResult | None
) -> None:
    with Progress(6, "prepare data", unit="stage") as bar:
        _build_stages(config, tmp, fingerprint, source_fp, bar, validated)
        bar.advance_to(6)


def _build_stages(
    config: PrepareConfig,
    tmp: Path,
    fingerprint: str,
    source_fp: str,
    bar,
    validated: ValidationResult | None,
) -> None:
    bar.stage("load")
    loaded = load_source(
        config.source,
        kind=config.kind,
        text_column=config.text_column,
        domain_column=config.domain_column,
        hub_config=config.hub_config,
        split=config.split,
        max_documents=config.max_documents,
        max_line_bytes=config.max_line_bytes,
        txt_sample_by=config.txt_sample_by,
    )
    texts, domains, counts = _documents(config, loaded)
    if not texts:
        raise DataError(f"{loaded.spec.name}: every document is empty; nothing to prepare")
    report = validated
    if validated is not None:
        validated.raise_for_failure()  # a failed report is never recorded as a passed preparation
    elif config.validate:
        bar.stage("validate")
        records = loaded.dataset if config.kind == "instruction" else [{"text": t} for t in texts]
        report = validate(records, config.kind, config.validation, source=loaded.spec.name)
        report.raise_for_failure()
    bar.stage("split")
    split_ids, split_counts = assign_splits(config, texts)
    counts.update(split_counts)

    bar.stage("tokenizer")
    if config.tokenizer is None:
        tokenizer = train_tokenizer((t for t, s in zip(texts, split_ids) if s == 0), config.vocab_size)
    else:
        tokenizer = load_tokenizer(config.tokenizer)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    vocab = len(tokenizer)
    dtype = config.dtype if config.dtype != "auto" else ("uint16" if vocab <= 2**16 else "uint32")
    if dtype == "uint16" and vocab > 2**16:
        raise DataError(
            f"dtype uint16 cannot hold token ids of a {vocab}-token vocabulary; use uint32 or auto"
        )

    domain_names = sorted(set(domains))
    if len(domain_names) > 255:
        raise DataError(
            f"{loaded.spec.name}: {len(domain_names)} domains; at most 255 fit the uint8 domain ids"
        )
    domain_index = {d: i for i, d in enumerate(domain_names)}
    bar.stage("tokenize")
    per_split = tokenize_documents(config, tokenizer, texts, [domain_index[d] for d in domains], split_ids)

    bar.stage("write")
    splits = {}
    for name, (tokens, doms, n_docs) in per_split.items():
        entry = write_split_shards(tmp, name, tokens, doms, config.seq_len, dtype, config.blocks_per_shard)
        splits[name] = {"documents": n_docs, **entry}
    if splits["train"]["num_blocks"] == 0:
        raise DataError(
            f"{loaded.spec.name}: the train split has {len(per_split['train'][0])} tokens, fewer than "
            f"one block of seq_len={config.seq_len}; use more documents or a shorter seq_len"
        )
    if report is not None:
        (tmp / "validation.md").write_text(report.to_markdown())
        (tmp / "validation.json").write_text(json.dumps(report.to_dict(), indent=1))
    tok_dir = tmp / "tokenizer"
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "source": {"name": loaded.spec.name, "type": loaded.spec.type, "fingerprint": source_fp},
        "config": config.to_dict(),
        "seq_len": config.seq_len,
        "dtype": dtype,
        "domains": domain_names,
        "tokenizer": {
            "hash": tokenizer_hash(tokenizer),
            "origin": config.tokenizer or "trained",
            "vocab_size": vocab,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "files": {p.name: sha256_file(p) for p in sorted(tok_dir.iterdir()) if p.is_file()},
        },
        "counts": {**counts, "documents_kept": sum(1 for s in split_ids if s >= 0)},
        "splits": splits,
        "validation": None
        if report is None
        else {"suite": report.suite, "success": report.success, "rows_checked": report.rows_checked},
        "versions": {"python": platform.python_version(), **_versions()},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _versions() -> dict[str, str]:
    import datasets
    import transformers

    return {
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }


__all__ = ["KINDS", "SPLITS", "PrepareConfig", "assign_splits", "config_fingerprint", "prepare"]
