"""MinHash LSH near-duplicate removal: the numpy path equals the definition, the S-curve parameters, and
planted near-duplicates removed by `prepare` (threshold in the manifest) while distinct documents stay."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from moe_core.data.minhash import (
    MinHasher,
    NearDuplicates,
    candidate_probability,
    lsh_params,
    minhash_signature,
    minhash_signature_reference,
    shingle_hashes,
    shingle_hashes_reference,
)
from moe_core.data.prepare import PrepareConfig, prepare
from moe_core.data.shards import read_manifest

VOCAB = [f"v{i}" for i in range(5000)]


def doc(rng: random.Random, n: int = 120) -> list[str]:
    return [rng.choice(VOCAB) for _ in range(n)]


def jaccard(a: str, b: str, n: int = 5) -> float:
    sa, sb = set(shingle_hashes_reference(a, n)), set(shingle_hashes_reference(b, n))
    return len(sa & sb) / len(sa | sb)


@pytest.mark.parametrize("text", ["", "one", "Two words!", "a b c d e f g h, I J K; l m n o p " * 3])
def test_fast_signature_equals_the_definition(text):
    hasher = MinHasher(num_perm=32, ngram=5, seed=3)
    assert shingle_hashes(text, 5).tolist() == shingle_hashes_reference(text, 5)
    assert minhash_signature(text, hasher).tolist() == minhash_signature_reference(text, hasher)


def test_signature_agreement_estimates_jaccard():
    rng = random.Random(0)
    base = doc(rng, 400)
    edited = list(base)
    for i in rng.sample(range(len(edited)), 8):
        edited[i] = rng.choice(VOCAB)
    a, b = " ".join(base), " ".join(edited)
    hasher = MinHasher(num_perm=256)
    agree = float(np.mean(minhash_signature(a, hasher) == minhash_signature(b, hasher)))
    assert abs(agree - jaccard(a, b)) < 0.1
    other = " ".join(doc(rng, 400))
    assert float(np.mean(minhash_signature(a, hasher) == minhash_signature(other, hasher))) < 0.05


def test_lsh_parameters_put_the_s_curve_at_the_threshold():
    for threshold in (0.5, 0.7, 0.8, 0.9):
        bands, rows = lsh_params(threshold, 128)
        assert bands * rows <= 128
        assert candidate_probability(np.array(threshold - 0.25), bands, rows) < 0.5
        assert candidate_probability(np.array(min(threshold + 0.1, 1.0)), bands, rows) > 0.5


def test_near_duplicates_in_stream_order_keep_the_first():
    rng = random.Random(1)
    a = doc(rng)
    near_a = a[:60] + ["changed"] + a[61:]
    dedup = NearDuplicates(threshold=0.8)
    assert [dedup.add(" ".join(d)) for d in (a, doc(rng), near_a, doc(rng))] == [False, False, True, False]
    assert dedup.describe()["threshold"] == 0.8 and dedup.describe()["bands"] == dedup.bands
    with pytest.raises(ValueError, match="threshold"):
        NearDuplicates(threshold=1.0)


def test_prepare_removes_planted_near_duplicates_and_records_the_threshold(tmp_path):
    rng = random.Random(2)
    originals = [doc(rng, 300) for _ in range(150)]
    planted = []
    for words in originals[:30]:  # near-duplicates: a few words changed, punctuation and case differ
        copy = list(words)
        copy[rng.randrange(len(copy))] = rng.choice(VOCAB)
        planted.append(" ".join(copy).upper() + " !!")
    texts = [" ".join(w) for w in originals] + planted
    # P[found] > 0.997 for each (9 bands of 13 rows at J > 0.95)
    assert min(jaccard(t, " ".join(w)) for t, w in zip(planted, originals)) > 0.95
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    common = dict(source=str(path), vocab_size=400, seq_len=32, validate=False)
    out = prepare(PrepareConfig(near_dedup=0.8, **common), tmp_path / "near")
    manifest = read_manifest(out)
    assert manifest["counts"]["near_duplicates_removed"] == 30
    assert manifest["counts"]["documents_kept"] == 150
    assert manifest["near_dedup"]["threshold"] == 0.8 and manifest["config"]["near_dedup"] == 0.8
    plain = read_manifest(prepare(PrepareConfig(**common), tmp_path / "plain"))
    assert plain["counts"]["near_duplicates_removed"] == 0 and plain["counts"]["documents_kept"] == 180
    assert plain["near_dedup"] is None
