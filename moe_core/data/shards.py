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
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_core.data.errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
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


def verify_prepared(data_dir: str | Path, splits: list[str] | None = None) -> dict[str, Any]:
    """Check the tokenizer files and the shards of `splits` (all by default) against the manifest's sha256;
    raise `DataError` naming the first file that is missing or does not match. Returns the manifest."""
    data_dir = Path(data_dir)
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
        self.data_dir = Path(data_dir)
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
