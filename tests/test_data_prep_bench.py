"""benchmarks/data_prep.py's datatrove part without datatrove: the corpus it plants duplicates in, the files it
cuts it into for datatrove's per-file tasks, the lab's MinHash parameters as datatrove's, the process-tree memory
watch both children report, and the cached environment datatrove runs in (reused, never rebuilt)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_core.data.minhash import NearDuplicates
from tests.bench_helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("data_prep")


def _texts(path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_planted_copies_follow_their_originals_and_leave_the_unique_documents_alone(bench, tmp_path):
    plain = _texts(bench.make_corpus(tmp_path / "plain.jsonl", 0.4))
    planted = _texts(bench.make_corpus(tmp_path / "planted.jsonl", 0.4, duplicates=0.3))
    firsts, exact, near = {}, 0, 0
    for text in planted:
        header = text.split("\n", 1)[0]
        if header not in firsts:
            firsts[header] = text
            continue
        original = firsts[header].split("\n")  # a copy keeps its original's header line
        lines = text.split("\n")
        changed = sum(a != b for a, b in zip(original, lines))
        assert len(lines) == len(original) and changed <= 1 and lines[0] == original[0]
        exact += changed == 0
        near += changed == 1
    uniques = list(firsts.values())
    assert uniques == plain[: len(uniques)]  # the same unique documents, fewer of them in the same size
    assert 0.2 < (exact + near) / len(uniques) < 0.4 and exact > 0 and near > 0


def test_the_corpus_is_cut_at_line_breaks_into_files_that_concatenate_to_it(bench, tmp_path):
    corpus = bench.make_corpus(tmp_path / "corpus.jsonl", 0.3)
    files = sorted(bench.split_corpus(corpus, 3, tmp_path / "parts").iterdir())
    assert [f.name for f in files] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert b"".join(f.read_bytes() for f in files) == corpus.read_bytes()
    sizes = [f.stat().st_size for f in files]
    assert all(f.read_bytes().endswith(b"\n") for f in files) and max(sizes) < 1.2 * min(sizes)


@pytest.mark.parametrize("threshold", [0.7, 0.8, 0.9])
def test_datatrove_gets_the_labs_shingles_bands_and_rows(bench, threshold):
    lab = NearDuplicates(threshold)
    mapped = bench.datatrove_minhash(threshold)
    assert mapped == {"n_grams": 5, "num_buckets": lab.bands, "hashes_per_bucket": lab.rows}
    assert mapped["num_buckets"] * mapped["hashes_per_bucket"] <= lab.hasher.num_perm


def test_the_tree_watch_sees_a_grandchild_and_the_whole_trees_memory():
    import child_memory  # benchmarks/ is on sys.path once data_prep is loaded

    # a pool's worker under a forkserver: a grandchild, never waited for by this process's child
    grandchild = "import time; x = bytearray(200 * 2**20); time.sleep(0.5)"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(0.8)"
    with child_memory.TreeMemory(poll_s=0.05) as tree:
        subprocess.run([sys.executable, "-c", child], check=True)
    assert tree.worker_peak_kib > 200 * 1024
    assert tree.tree_peak_kib > tree.worker_peak_kib  # this process and the child too


def test_a_built_environment_is_reused_and_a_new_pin_names_a_new_one(bench, tmp_path, monkeypatch):
    import envs

    home = tmp_path / "tool-1.0"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "python").touch()

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(envs.venv, "EnvBuilder", no_build)
    assert envs.cached_env(home, ["tool==1.0"], system_site_packages=False) == str(home / "bin" / "python")
    with pytest.raises(AssertionError, match="built again"):
        envs.cached_env(tmp_path / "tool-1.1", ["tool==1.1"], system_site_packages=False)
