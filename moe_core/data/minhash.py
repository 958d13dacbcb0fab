"""Near-duplicate detection: MinHash signatures and locality-sensitive hashing (LSH) by bands.

The recipe datatrove, Dolma and RefinedWeb apply to web corpora (Broder, "On the resemblance and containment
of documents", 1997; Leskovec, Rajaraman & Ullman, "Mining of Massive Datasets", ch. 3):

1. Shingles: a document is the set of its word n-grams (``ngram`` words, lower-cased, punctuation removed).
2. MinHash: K hash functions h_k(x) = ((a_k * x + b_k) mod p) with p = 2^61 - 1 and a_k in [1, p), b_k in
   [0, p) drawn from a seeded generator, applied to each shingle's 32-bit hash x; the signature is
   min_x h_k(x) for each k. a_k must span [1, p): with small multipliers a shingle with a small hash x
   would give a small h_k(x) for every k and win most minimums. a_k * x needs 93 bits; `_mul_mod_p` computes
   it exactly in uint64 (datasketch lets it wrap at 2^64 instead).
   P[sig_k(A) = sig_k(B)] = Jaccard(A, B).
3. LSH: the K values are cut into ``bands`` bands of ``rows`` values; two documents whose signatures agree on
   every value of at least one band are candidates. P[candidate] = 1 - (1 - J^rows)^bands, an S-curve that
   rises around J = (1/bands)^(1/rows); `lsh_params` picks (bands, rows) for a threshold the way datasketch
   does, minimising the false-positive and false-negative areas under that curve.

`NearDuplicates.add` answers, for documents in stream order, whether a document shares a band with an
earlier one (then it is a near-duplicate: the first of each group is kept). Memory: one 8-byte key per band
per document.

Legend: S = shingles of one document, K = hash functions (num_perm).

`minhash_signature` is the numpy path; `minhash_signature_reference` is the same computation as plain Python
loops over hash functions and shingles, and a test holds them equal.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass

import numpy as np

MERSENNE_P = (1 << 61) - 1
MAX_SHINGLE_HASH = (1 << 32) - 1
_WORD = re.compile(r"\w+")
_SHINGLE_BASE = 1_000_003  # polynomial hash of the n words' crc32s, mod 2^32


def words(text: str) -> list[str]:
    """The normalised words of a text: lower-cased runs of letters and digits (punctuation and spacing
    differences do not make two documents different)."""
    return _WORD.findall(text.lower())


def _word_hashes(text: str) -> list[int]:
    return [zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in words(text)]


def shingle_hashes_reference(text: str, ngram: int) -> list[int]:
    """32-bit hashes of the word n-grams, one per position (a text shorter than n words is one shingle):
    h = sum_j crc32(word_{i+j}) * BASE^(n-1-j) mod 2^32."""
    w = _word_hashes(text)
    if not w:
        return []
    n = min(ngram, len(w))
    out = []
    for i in range(len(w) - n + 1):
        h = 0
        for j in range(n):
            h = (h * _SHINGLE_BASE + w[i + j]) & MAX_SHINGLE_HASH
        out.append(h)
    return out


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """`shingle_hashes_reference` with numpy: uint64 [S], values < 2^32."""
    w_S = np.asarray(_word_hashes(text), dtype=np.uint64)
    if len(w_S) == 0:
        return w_S
    n = min(ngram, len(w_S))
    count = len(w_S) - n + 1
    h_S = np.zeros(count, dtype=np.uint64)
    mask, base = np.uint64(MAX_SHINGLE_HASH), np.uint64(_SHINGLE_BASE)
    for j in range(n):  # Horner's rule over the n words of every shingle at once; stays below 2^64
        h_S = (h_S * base + w_S[j : j + count]) & mask
    return h_S


def _mul_mod_p(x_S: np.ndarray, a_K: np.ndarray) -> np.ndarray:
    """(a_k * x_s) mod p up to a multiple of p, exactly, in uint64 [S, K] (values < 2^63), for x < 2^32 and
    a < 2^61: with a = a_hi * 2^29 + a_lo and y = a_hi * x = y_hi * 2^32 + y_lo,
    a * x = y * 2^29 + a_lo * x = y_hi * 2^61 + y_lo * 2^29 + a_lo * x, and 2^61 = 1 (mod p)."""
    a_hi_K, a_lo_K = a_K >> np.uint64(29), a_K & np.uint64((1 << 29) - 1)
    y_SK = x_S[:, None] * a_hi_K[None, :]  # < 2^64
    low_SK = x_S[:, None] * a_lo_K[None, :]  # < 2^61
    return (y_SK >> np.uint64(32)) + ((y_SK & np.uint64(MAX_SHINGLE_HASH)) << np.uint64(29)) + low_SK


@dataclass(frozen=True)
class MinHasher:
    """K hash functions (a_k, b_k) drawn from ``seed``."""

    num_perm: int = 128
    ngram: int = 5
    seed: int = 1

    def params(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        a_K = rng.integers(1, MERSENNE_P, size=self.num_perm, dtype=np.uint64)
        b_K = rng.integers(0, MERSENNE_P, size=self.num_perm, dtype=np.uint64)
        return a_K, b_K


def minhash_signature(
    text: str, hasher: MinHasher, params: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """uint64 [K]: min over shingles of ((a_k * x + b_k) mod p); all p for a text without words."""
    a_K, b_K = params if params is not None else hasher.params()
    x_S = shingle_hashes(text, hasher.ngram)
    if len(x_S) == 0:
        return np.full(hasher.num_perm, MERSENNE_P, dtype=np.uint64)
    h_SK = (_mul_mod_p(x_S, a_K) + b_K[None, :]) % np.uint64(MERSENNE_P)  # < 2^63 + 2^61 before the mod
    return h_SK.min(axis=0)


def minhash_signature_reference(text: str, hasher: MinHasher) -> list[int]:
    """The signature as the definition reads: for each hash function, the minimum over the shingles."""
    a_K, b_K = hasher.params()
    shingles = shingle_hashes_reference(text, hasher.ngram)
    signature = []
    for a, b in zip(a_K.tolist(), b_K.tolist()):
        signature.append(min(((a * x + b) % MERSENNE_P for x in shingles), default=MERSENNE_P))
    return signature


def candidate_probability(jaccard: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """P[two documents with this Jaccard similarity share a band] = 1 - (1 - J^rows)^bands."""
    return 1.0 - (1.0 - jaccard**rows) ** bands


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm minimising the false-positive area (candidates below the
    threshold) plus the false-negative area (missed pairs above it), as datasketch's `_optimal_param`."""
    best, best_err = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            lo = np.linspace(0.0, threshold, 200)
            hi = np.linspace(threshold, 1.0, 200)
            fp = np.trapezoid(candidate_probability(lo, bands, rows), lo)
            fn = np.trapezoid(1.0 - candidate_probability(hi, bands, rows), hi)
            if fp + fn < best_err:
                best, best_err = (bands, rows), fp + fn
    return best


class NearDuplicates:
    """Documents in stream order; `add` returns True when the document shares an LSH band with an earlier
    one (a near-duplicate of it). Every document's bands are remembered, so a group of mutually similar
    documents keeps its first member."""

    def __init__(self, threshold: float, num_perm: int = 128, ngram: int = 5, seed: int = 1) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"near-duplicate threshold={threshold!r}: must be between 0 and 1 (exclusive)")
        self.threshold = threshold
        self.hasher = MinHasher(num_perm, ngram, seed)
        self.bands, self.rows = lsh_params(threshold, num_perm)
        self._params = self.hasher.params()
        self._seen: list[set[int]] = [set() for _ in range(self.bands)]

    def band_keys(self, text: str) -> list[int]:
        sig_K = minhash_signature(text, self.hasher, self._params)
        return [
            int.from_bytes(
                hashlib.blake2b(sig_K[i * self.rows : (i + 1) * self.rows].tobytes(), digest_size=8).digest(),
                "big",
            )
            for i in range(self.bands)
        ]

    def add(self, text: str) -> bool:
        return self.add_keys(self.band_keys(text))

    def add_keys(self, keys: list[int] | tuple[int, ...]) -> bool:
        """`add` of a document whose `band_keys` were computed elsewhere (a worker's part of the scan)."""
        duplicate = any(key in seen for key, seen in zip(keys, self._seen))
        for key, seen in zip(keys, self._seen):
            seen.add(key)
        return duplicate

    def describe(self) -> dict[str, float | int]:
        return {
            "threshold": self.threshold,
            "num_perm": self.hasher.num_perm,
            "ngram": self.hasher.ngram,
            "seed": self.hasher.seed,
            "bands": self.bands,
            "rows": self.rows,
        }


__all__ = [
    "MinHasher",
    "NearDuplicates",
    "candidate_probability",
    "lsh_params",
    "minhash_signature",
    "minhash_signature_reference",
    "shingle_hashes",
    "shingle_hashes_reference",
]
