"""Packed token shards: fixed-length blocks of token ids in memory-mapped ``.npy`` files, plus a parallel
array of per-token domain ids (uint8), described by ``manifest.json``.

Layout of a prepared directory::

    manifest.json                       tokenizer hash, counts, source fingerprint, shards and their sha256
    tokenizer/                          a transformers tokenizer directory
    validation.md, validation.json      the great-expectations report (row indices and hashes, no text)
    train/train-00000.tokens.npy        uint16 or uint32, shape [blocks, seq_len]
    train/train-00000.domains.npy       uint8, shape [blocks, seq_len]; names in manifest["domains"]
    validation/..., test/...

`PackedTokens` reads one split; with ``verify=True`` it checks every shard (and the tokenizer files)
against the manifest's sha256 and raises `DataError` naming the file that does not match.

Every reader here also takes a URL (`prepared_dir`): ``file://`` is read in place; any other fsspec protocol
(``s3://``, ``gs://``, ``hf://``, ...: the matching fsspec package must be installed, e.g. ``s3fs``) is fetched
once into the lab's data directory, file by file as the readers ask for them (the manifest and tokenizer first,
then the shards of the splits read), each file checked against the manifest's sha256 before it is renamed into
place, and reused while the remote manifest is unchanged. Shards are memory-mapped from that local copy, so a
node needs disk for the splits it trains on (no eviction: a corpus larger than a node's disk is not served yet).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

from moe_core.data.errors import DataError
from moe_core.paths import is_url, lab_data_dir

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ URLs
def prepared_dir(location: str | os.PathLike, splits: list[str] | None = None) -> Path:
    """A local prepared-data directory for ``location``: a path as it is; a ``file://`` URL as its path; any
    other URL fetched into ``<lab data dir>/remote/`` (see the module docstring): the manifest and tokenizer,
    and the shards of ``splits`` (all when None, none for ``[]``)."""
    if not is_url(location):
        return Path(location)
    url = str(location).rstrip("/")
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise DataError(
            f"{url}: cannot open this URL ({err}); install the fsspec implementation of its protocol "
            "(for example `pip install s3fs` for s3://, gcsfs for gs://)"
        ) from None
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return Path(root)
    try:
        raw = fs.cat_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        raise DataError(
            f"{url}: no {MANIFEST}; this is not a prepared-data directory (upload the whole output of "
            "`moe-lab data prepare`)"
        ) from None
    except OSError as err:
        raise DataError(f"{url}/{MANIFEST}: unreadable ({err.__class__.__name__}: {err})") from None
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", url.split("://", 1)[1])[-60:]
    local = lab_data_dir() / "remote" / f"{name}-{hashlib.sha256(url.encode() + raw).hexdigest()[:12]}"
    local.mkdir(parents=True, exist_ok=True)
    with _locked(local / ".fetch.lock"):  # one fetch per file on a node: other ranks wait, then reuse it
        if not (local / MANIFEST).is_file():
            _write_atomic(local / MANIFEST, raw)
        manifest = read_manifest(local)
        wanted = [f"tokenizer/{n}" for n in manifest["tokenizer"]["files"]]
        digests = dict(zip(wanted, manifest["tokenizer"]["files"].values(), strict=True))
        for split in list(manifest["splits"]) if splits is None else splits:
            for shard in manifest["splits"].get(split, {}).get("shards", []):
                for kind in ("tokens", "domains"):
                    wanted.append(shard[kind])
                    digests[shard[kind]] = shard["sha256"][kind]
        for relative in wanted:
            if not (local / relative).is_file():
                _fetch_checked(
                    fs, f"{root}/{relative}", local / relative, digests[relative], f"{url}/{relative}"
                )
    return local


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)


def _fetch_checked(fs, remote: str, path: Path, digest: str, shown: str) -> None:
    """Copy one remote file next to ``path``, check its sha256, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with fs.open(remote, "rb") as source, open(partial, "wb") as target:
            while chunk := source.read(1 << 22):
                h.update(chunk)
                target.write(chunk)
        if h.hexdigest() != digest:
            raise DataError(
                f"{shown}: checksum mismatch with the manifest; the remote copy is corrupt or was modified "
                "(upload the prepared directory again)"
            )
        partial.replace(path)
    except FileNotFoundError:
        raise DataError(
            f"{shown}: missing in the remote prepared directory (listed in its manifest)"
        ) from None
    except OSError as err:
        raise DataError(f"{shown}: could not be fetched ({err.__class__.__name__}: {err})") from None
    finally:
        partial.unlink(missing_ok=True)


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    data_dir = prepared_dir(data_dir, splits=[])
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{data_dir}: no {MANIFEST}; this is not a prepared-data directory. "
            "Run `moe-lab data prepare SOURCE --out DIR` first"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(
            f"{path}: broken manifest ({err.__class__.__name__}); re-run `moe-lab data prepare` "
            "with --overwrite"
        ) from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}; "
            "re-run `moe-lab data prepare` with --overwrite"
        )
    return manifest


def write_split_shards(
    out_dir: Path,
    split: str,
    tokens: np.ndarray,
    domains: np.ndarray,
    seq_len: int,
    dtype: str,
    blocks_per_shard: int,
) -> dict[str, Any]:
    """Pack `tokens` (1-D, documents already joined with EOS) into [blocks, seq_len] shards; the tail that
    does not fill a block is dropped. Returns the split's manifest entry."""
    n_blocks = len(tokens) // seq_len
    tokens_BS = tokens[: n_blocks * seq_len].reshape(n_blocks, seq_len)
    domains_BS = domains[: n_blocks * seq_len].reshape(n_blocks, seq_len)
    (out_dir / split).mkdir(parents=True, exist_ok=True)
    shards = []
    for k, start in enumerate(range(0, n_blocks, blocks_per_shard)):
        stop = min(start + blocks_per_shard, n_blocks)
        entry: dict[str, Any] = {"num_blocks": stop - start, "sha256": {}}
        for name, array, dt in (("tokens", tokens_BS, dtype), ("domains", domains_BS, "uint8")):
            rel = f"{split}/{split}-{k:05d}.{name}.npy"
            np.save(out_dir / rel, np.ascontiguousarray(array[start:stop], dtype=dt))
            entry[name] = rel
            entry["sha256"][name] = sha256_file(out_dir / rel)
        shards.append(entry)
    return {
        "num_blocks": n_blocks,
        "num_tokens": n_blocks * seq_len,
        "dropped_tail_tokens": len(tokens) - n_blocks * seq_len,
        "shards": shards,
    }


class ShardWriter:
    """`write_split_shards` fed piece by piece: tokens (documents already joined with EOS) arrive in order
    through `append`, and each [blocks_per_shard, seq_len] shard is written (``np.save`` + sha256) as soon as
    it is full, so memory holds at most one shard plus the piece. `finish` writes the last, shorter shard and
    drops the tail that does not fill a block; the files and the manifest entry are byte for byte those of
    `write_split_shards` on the concatenated tokens (a test holds them equal).

    `state` / `from_state` carry a writer over a restart: the shards written and the pending tokens."""

    def __init__(self, out_dir: Path, split: str, seq_len: int, dtype: str, blocks_per_shard: int) -> None:
        self.out_dir, self.split, self.seq_len = Path(out_dir), split, seq_len
        self.dtype, self.blocks_per_shard = dtype, blocks_per_shard
        self.shards: list[dict[str, Any]] = []
        self.total_tokens = 0
        self._tokens: list[np.ndarray] = []
        self._domains: list[np.ndarray] = []
        self._pending = 0
        (self.out_dir / split).mkdir(parents=True, exist_ok=True)

    @property
    def shard_tokens(self) -> int:
        return self.blocks_per_shard * self.seq_len

    def append(self, tokens: np.ndarray, domains: np.ndarray) -> int:
        """Add tokens and their domain ids (same length); returns how many shards this wrote."""
        if len(tokens) != len(domains):
            raise ValueError(f"{len(tokens)} tokens but {len(domains)} domain ids")
        self._tokens.append(tokens)
        self._domains.append(domains)
        self._pending += len(tokens)
        self.total_tokens += len(tokens)
        if self._pending < self.shard_tokens:
            return 0
        tokens, domains = np.concatenate(self._tokens), np.concatenate(self._domains)
        start = 0
        while len(tokens) - start >= self.shard_tokens:
            stop = start + self.shard_tokens
            self._write(tokens[start:stop], domains[start:stop])
            start = stop
        self._tokens, self._domains, self._pending = [tokens[start:]], [domains[start:]], len(tokens) - start
        return start // self.shard_tokens

    def _write(self, tokens: np.ndarray, domains: np.ndarray) -> None:
        n_blocks = len(tokens) // self.seq_len
        k = len(self.shards)
        entry: dict[str, Any] = {"num_blocks": n_blocks, "sha256": {}}
        for name, array, dt in (("tokens", tokens, self.dtype), ("domains", domains, "uint8")):
            rel = f"{self.split}/{self.split}-{k:05d}.{name}.npy"
            block_BS = np.ascontiguousarray(array.reshape(n_blocks, self.seq_len), dtype=dt)
            np.save(self.out_dir / rel, block_BS)
            entry[name] = rel
            entry["sha256"][name] = sha256_file(self.out_dir / rel)
        self.shards.append(entry)

    def finish(self) -> dict[str, Any]:
        """Write the last shard; returns the split's manifest entry (as `write_split_shards`)."""
        n_blocks = self._pending // self.seq_len
        if n_blocks:
            tokens, domains = np.concatenate(self._tokens), np.concatenate(self._domains)
            self._write(tokens[: n_blocks * self.seq_len], domains[: n_blocks * self.seq_len])
        total = sum(s["num_blocks"] for s in self.shards)
        return {
            "num_blocks": total,
            "num_tokens": total * self.seq_len,
            "dropped_tail_tokens": self.total_tokens - total * self.seq_len,
            "shards": self.shards,
        }

    def state(self) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        """(json-able state, pending tokens, pending domain ids)."""
        tokens = np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int64)
        domains = np.concatenate(self._domains) if self._domains else np.zeros(0, np.uint8)
        self._tokens, self._domains = [tokens], [domains]
        return {"shards": self.shards, "total_tokens": self.total_tokens}, tokens, domains

    @classmethod
    def from_state(
        cls,
        out_dir: Path,
        split: str,
        seq_len: int,
        dtype: str,
        blocks_per_shard: int,
        state: dict[str, Any],
        tokens: np.ndarray,
        domains: np.ndarray,
    ) -> ShardWriter:
        writer = cls(out_dir, split, seq_len, dtype, blocks_per_shard)
        writer.shards, writer.total_tokens = list(state["shards"]), int(state["total_tokens"])
        writer._tokens, writer._domains, writer._pending = [tokens], [domains], len(tokens)
        return writer


def verify_prepared(data_dir: str | Path, splits: list[str] | None = None) -> dict[str, Any]:
    """Check the tokenizer files and the shards of `splits` (all by default) against the manifest's sha256;
    raise `DataError` naming the first file that is missing or does not match. Returns the manifest."""
    data_dir = prepared_dir(data_dir, splits)
    manifest = read_manifest(data_dir)
    redo = "the prepared data is corrupt or was modified; re-run `moe-lab data prepare` with --overwrite"
    for name, digest in manifest["tokenizer"]["files"].items():
        path = data_dir / "tokenizer" / name
        if not path.is_file():
            raise DataError(f"{path}: missing tokenizer file; {redo}")
        if sha256_file(path) != digest:
            raise DataError(
                f"{path}: checksum mismatch with the manifest (tokenizer {manifest['tokenizer']['hash'][:12]}); "
                f"{redo}"
            )
    for split in splits if splits is not None else list(manifest["splits"]):
        if split not in manifest["splits"]:
            raise DataError(f"{data_dir}: no split {split!r}; prepared splits: {list(manifest['splits'])}")
        for shard in manifest["splits"][split]["shards"]:
            for kind in ("tokens", "domains"):
                path = data_dir / shard[kind]
                if not path.is_file():
                    raise DataError(f"{path}: missing shard; {redo}")
                if sha256_file(path) != shard["sha256"][kind]:
                    raise DataError(f"{path}: checksum mismatch with the manifest; {redo}")
    return manifest


class PackedTokens(torch.utils.data.Dataset):
    """Blocks of one split of a prepared directory. ``ds[i]`` is a LongTensor [seq_len] read from the
    memory-mapped shard; ``ds.domains(i)`` the per-token domain ids (names: ``ds.domain_names``)."""

    def __init__(self, data_dir: str | Path, split: str = "train", verify: bool = True) -> None:
        self.data_dir = prepared_dir(data_dir, [split])
        self.manifest = verify_prepared(self.data_dir, [split]) if verify else read_manifest(self.data_dir)
        if split not in self.manifest["splits"]:
            raise DataError(
                f"{self.data_dir}: no split {split!r}; prepared splits: {list(self.manifest['splits'])}"
            )
        self.split = split
        self.seq_len: int = int(self.manifest["seq_len"])
        self.vocab_size: int = int(self.manifest["tokenizer"]["vocab_size"])
        self.eos_token_id: int = int(self.manifest["tokenizer"]["eos_token_id"])
        self.domain_names: list[str] = list(self.manifest["domains"])
        self._tokens: list[np.ndarray] = []
        self._domains: list[np.ndarray] = []
        for shard in self.manifest["splits"][split]["shards"]:
            for kind, arrays, dtype in (
                ("tokens", self._tokens, self.manifest["dtype"]),
                ("domains", self._domains, "uint8"),
            ):
                path = self.data_dir / shard[kind]
                try:
                    array = np.load(path, mmap_mode="r")
                except (OSError, ValueError) as err:
                    raise DataError(
                        f"{path}: unreadable shard ({err.__class__.__name__}); re-run "
                        "`moe-lab data prepare` with --overwrite"
                    ) from None
                if array.shape != (shard["num_blocks"], self.seq_len) or array.dtype != np.dtype(dtype):
                    raise DataError(
                        f"{path}: shape {array.shape} {array.dtype}, manifest says "
                        f"({shard['num_blocks']}, {self.seq_len}) {dtype}; re-run "
                        "`moe-lab data prepare` with --overwrite"
                    )
                arrays.append(array)
        self._starts = np.cumsum([0] + [len(a) for a in self._tokens])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"block {i} out of range for split {self.split!r} with {n} blocks")
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        return shard, i - int(self._starts[shard])

    def __getitem__(self, i: int) -> torch.Tensor:
        shard, row = self._locate(int(i))
        return torch.from_numpy(self._tokens[shard][row].astype(np.int64))

    def domains(self, i: int) -> torch.Tensor:
        """Per-token domain ids of block `i` (LongTensor [seq_len]); names in `domain_names`."""
        shard, row = self._locate(int(i))
        return torch.from_numpy(self._domains[shard][row].astype(np.int64))

    def block_domain(self, i: int) -> int:
        """The majority domain id of block `i`."""
        shard, row = self._locate(int(i))
        return int(np.bincount(self._domains[shard][row]).argmax())

    def get_batch(self, indices: list[int]) -> torch.Tensor:
        """LongTensor [len(indices), seq_len] of the given blocks."""
        if not len(indices):
            return torch.empty(0, self.seq_len, dtype=torch.long)
        return torch.stack([self[i] for i in indices])
