"""Data preparation at scale (issue 34 §3): peak memory and seconds per MB as the corpus grows, `--num-proc`
scaling, and the tokenizer library's own batch throughput, measured in one run.

Corpora: jsonl files of unique documents, each a header line ("document N: <stdlib file>:<line>") followed by a
run of 20-80 lines of the running interpreter's standard library (cycled for large sizes), written once per
size under ``--work-dir`` (reused when present); the datatrove part's with planted copies (`make_corpus`).

Parts (each preparation runs in a child process of its own, one at a time: ``moe-lab data prepare`` as a user
runs it, with ``--vocab-size 4000`` and validation on):
  sizes    one preparation per ``--sizes`` (MB): the child's peak resident set (``ru_maxrss``, the reader's
           process) and its workers' (``RUSAGE_CHILDREN``), seconds per MB; ratios against the smallest size
           (targets: peak RSS at 320 MB within 1.3x of 40 MB's, s/MB within 1.25x)
  procs    the ``--procs-mb`` corpus prepared with each ``--procs`` value, interleaved over ``--rounds`` rounds
           (target: 2 processes >= 1.7x faster than 1 on 2 idle cores), MB/s per core; beside it the
           tokenizer's own ``encode_batch_fast`` on the same text with one thread (``TOKENIZERS_PARALLELISM=false``),
           the bound of the tokenize stage per core
  engines  the ``--procs-mb`` corpus prepared by one local process and on a local Ray cluster of
           ``max(--procs)`` CPUs (started before the clock; parts of ``--part-mb``), interleaved: seconds, and
           the driving process's own CPU per MB (what bounds a cluster run when the driver reads and scans)
  datatrove  the same work done by datatrove (issue 34 §2): a ``--procs-mb`` corpus with planted copies
           (``--duplicates``), exact and (``--near-dedup``) MinHash deduplication and tokenization with the
           tokenizer the lab trained on it, by the lab (``--num-proc max(--procs)``; locally, with and without its
           validation suite, and on Ray) and by datatrove's own blocks under its `LocalPipelineExecutor` with
           ``max(--procs)`` tasks and workers (`child_datatrove`), interleaved: seconds, MB/s, peak RSS of the
           driver, of the largest worker and of the whole process tree, documents each removed and kept,
           tokens written, lab / datatrove ratios.
           datatrove runs in its own virtual environment, built on first use under
           ``~/.cache/moe-lab/envs/datatrove-<version>-...`` (`DATATROVE`)

    python benchmarks/data_prep.py                                  # sizes 40 320 1000, procs 1 2 on 320 MB
    python benchmarks/data_prep.py --sizes 40 320 --parts sizes     # memory figures only
    python benchmarks/data_prep.py --parts engines --procs-mb 40 --part-mb 8 --near-dedup 0.8   # local vs Ray
    python benchmarks/data_prep.py --parts datatrove --procs-mb 40 --near-dedup 0.8   # the lab vs datatrove

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

# Only the standard library at the top (the sibling modules are standard library too): this file is also the
# children's program, and the datatrove child runs under datatrove's own environment, where the lab is not
# installed. The siblings are found also when this file is loaded from its path (the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_memory import TreeMemory  # noqa: E402
from envs import ENVS_ROOT, cached_env  # noqa: E402

GIB = 2**30
HERE = Path(__file__).resolve()
DUPLICATE_WINDOW = 1000  # make_corpus: a planted copy is of one of this many last documents

# The datatrove part: the newest release when it was written, in a virtual environment of its own (its
# requirements never meet the project's constraints.txt), with what its blocks here need and no more: orjson
# (JsonlReader), regex (its text normalisation), xxhash (its hashes), spaCy (its English word tokenizer for
# MinHash shingles: a blank pipeline, no model to download); tokenizers is pinned to this environment's, so both
# sides encode with the same library.
DATATROVE = "0.10.1"
DATATROVE_REQUIREMENTS = [
    f"datatrove=={DATATROVE}",
    "orjson==3.13.0",
    "regex==2026.11.19",
    "spacy==3.8.18",
    "xxhash==3.8.2",
]


# ---------------------------------------------------------------------------------------------- corpora
def _stdlib_lines():
    from moe_core.data.sources import stdlib_files

    while True:  # cycled: a 1 GB corpus needs the ~30 MB standard library many times over
        for rel, path in stdlib_files():
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (UnicodeDecodeError, OSError):
                continue
            for n, line in enumerate(lines, start=1):
                yield rel, n, line


def make_corpus(path: Path, megabytes: float, duplicates: float = 0.0) -> Path:
    """A jsonl file of about ``megabytes`` MB of unique documents (see the module docstring). With
    ``duplicates`` > 0, after each document, with that probability, a copy of one of the last
    `DUPLICATE_WINDOW` unique documents: half of them exact, half with one line of the body replaced by a line
    of another (a near-duplicate: for a document of 20-80 lines, a word 5-gram Jaccard similarity of about 0.9;
    less for a few, whose replaced line held most of their words, or which got an identical line back).
    The unique documents are the same as without copies."""
    if path.is_file():
        return path
    import random

    rng = random.Random(0)
    copies = random.Random(1)  # a generator of its own: the unique documents do not depend on `duplicates`
    target = int(megabytes * 1e6)
    lines = _stdlib_lines()
    recent: collections.deque[list[str]] = collections.deque(maxlen=DUPLICATE_WINDOW)
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        i = 0
        while written < target:
            rel, n, first = next(lines)
            body = [first] + [next(lines)[2] for _ in range(rng.randint(20, 80))]
            doc = [f"document {i}: {rel}:{n}", *body]
            rows = [doc]
            recent.append(doc)
            if duplicates and copies.random() < duplicates:
                copy = list(copies.choice(recent))
                if copies.random() < 0.5:  # a line of another recent document: the stream is not read
                    copy[copies.randrange(1, len(copy))] = copies.choice(copies.choice(recent)[1:])
                rows.append(copy)
            for row in rows:
                line = json.dumps({"text": "\n".join(row)}) + "\n"
                f.write(line)
                written += len(line.encode())
            i += 1
    os.replace(tmp, path)
    return path


def split_corpus(corpus: Path, parts: int, directory: Path) -> Path:
    """``corpus`` cut at line breaks into ``parts`` files of about equal size, in order (their concatenation is
    ``corpus``): datatrove's readers give each task whole files, so one file would run on one task."""
    if directory.is_dir():
        return directory
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    size, part, written = corpus.stat().st_size, 0, 0
    out = open(tmp / f"part-{part:05d}.jsonl", "wb")
    with open(corpus, "rb") as f:
        for line in f:
            if written >= size * (part + 1) / parts and part < parts - 1:
                out.close()
                part += 1
                out = open(tmp / f"part-{part:05d}.jsonl", "wb")
            out.write(line)
            written += len(line)
    out.close()
    os.replace(tmp, directory)
    return directory


# ---------------------------------------------------------------------------------------------- children
def child_prepare(
    corpus: str,
    out: str,
    num_proc: int,
    vocab_size: int,
    engine: str = "local",
    part_mb: float | None = None,
    near_dedup: float | None = None,
    tokenizer: str | None = None,
    validate: bool = True,
) -> None:
    from moe_core.data import stream
    from moe_core.data.prepare import PrepareConfig, prepare

    ray_start = 0.0
    if engine == "ray":  # the cluster started before the clock: a user's cluster is already up
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=num_proc, include_dashboard=False, log_to_driver=False)
        ray_start = time.perf_counter() - t0
    if part_mb:
        stream.PART_BYTES = int(part_mb * 1e6)
    config = PrepareConfig(
        source=corpus,
        vocab_size=vocab_size,
        num_proc=num_proc,
        engine=engine,
        near_dedup=near_dedup,
        tokenizer=tokenizer,
        validate=validate,
    )
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with TreeMemory() as tree:
        prepare(config, out, overwrite=True)
    seconds = time.perf_counter() - t0
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    counts = manifest["counts"]
    print(
        json.dumps(
            {
                "seconds": seconds,
                "driver_cpu_s": own.ru_utime + own.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                "ray_start_s": ray_start,
                "peak_rss_gib": own.ru_maxrss * 1024 / GIB,  # KiB on Linux
                "workers_peak_rss_gib": max(children.ru_maxrss, tree.worker_peak_kib) * 1024 / GIB,
                "tree_peak_rss_gib": tree.tree_peak_kib * 1024 / GIB,
                "documents_read": counts["documents_loaded"],
                "duplicates_removed": counts["duplicates_removed"],
                "near_duplicates_removed": counts["near_duplicates_removed"],
                "documents_kept": counts["documents_kept"],
                # every token encoded, EOS included: the packed blocks and the tails too short for a block
                "tokens": sum(
                    v["num_tokens"] + v["dropped_tail_tokens"] for v in manifest["splits"].values()
                ),
            }
        )
    )


def child_datatrove(
    shards: str, out: str, num_proc: int, tokenizer: str, eos: str, minhash: dict | None
) -> None:
    """datatrove's own pipeline for the lab's work, each stage a `LocalPipelineExecutor` with ``num_proc``
    workers, run one after the other as its examples chain them (`depends=`):

      exact-signature   read -> ExactDedupSignature (xxhash64 of the text)          1st read of the source
      exact-find        ExactFindDedups, one task per hash range
      minhash-signature read -> ExactDedupFilter -> MinhashDedupSignature           2nd read (``minhash``)
      minhash-buckets   MinhashDedupBuckets, one task per band
      minhash-cluster   MinhashDedupCluster, one task (union-find over the pairs)
      tokenize          read -> ExactDedupFilter [-> MinhashDedupFilter] -> DocumentTokenizer   last read

    The filters run again in the last stage instead of writing the deduplicated documents out: a document's id
    in datatrove's dedup files is its index in its task's stream, the same in both stages. Runs under
    datatrove's environment (`datatrove_python`)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.utils.text import TextNormConfig

    work = Path(out)
    shutil.rmtree(work, ignore_errors=True)  # the executor skips the tasks its logs mark done

    def at(name: str) -> str:  # datatrove's folders are strings (or fsspec folders), not Paths
        return str(work / name)

    exact = ExactDedupConfig(content_getter=_document_text)
    config = (
        MinhashConfig(
            n_grams=minhash["n_grams"],
            num_buckets=minhash["num_buckets"],
            hashes_per_bucket=minhash["hashes_per_bucket"],
            # the lab's `minhash.words`: lower-cased, punctuation removed, numbers kept as they are
            norm_config=TextNormConfig(norm_numbers=False, norm_unicode_diacritics=False),
        )
        if minhash
        else None
    )

    stages: list[tuple[str, list, int]] = [
        (
            "exact-signature",
            [JsonlReader(shards), ExactDedupSignature(at("exact-sigs"), exact, finder_workers=num_proc)],
            num_proc,
        ),
        ("exact-find", [ExactFindDedups(at("exact-sigs"), at("exact-dups"), config=exact)], num_proc),
    ]
    if config:
        stages += [
            (
                "minhash-signature",
                [
                    JsonlReader(shards),
                    ExactDedupFilter(at("exact-dups"), config=exact),
                    MinhashDedupSignature(at("minhash-sigs"), config=config),
                ],
                num_proc,
            ),
            (
                "minhash-buckets",
                [MinhashDedupBuckets(at("minhash-sigs"), at("minhash-buckets"), config=config)],
                config.num_buckets,
            ),
            (
                "minhash-cluster",
                [MinhashDedupCluster(at("minhash-buckets"), at("minhash-remove"), config=config)],
                1,
            ),
        ]
    # shuffle_documents off: the lab packs in stream order (datatrove's default shuffles, a second copy)
    tokenize = DocumentTokenizer(at("tokens"), tokenizer, eos_token=eos, shuffle_documents=False)
    filters = [ExactDedupFilter(at("exact-dups"), config=exact)]
    if config:
        filters.append(MinhashDedupFilter(at("minhash-remove")))
    stages.append(("tokenize", [JsonlReader(shards), *filters, tokenize], num_proc))

    stage_s: dict[str, float] = {}
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with TreeMemory() as tree:
        for name, pipeline, tasks in stages:
            t_stage = time.perf_counter()
            executor = LocalPipelineExecutor(
                pipeline, tasks=tasks, workers=min(tasks, num_proc), logging_dir=at(f"logs/{name}")
            )
            stats = executor.run()
            stage_s[name] = time.perf_counter() - t_stage
    seconds = time.perf_counter() - t0
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # the last stage's steps in pipeline order, each summed over the tasks: reader, filters, tokenizer
    reader, exact_filter, *minhash_filter, tokenizer_step = stats.stats
    filtered = minhash_filter[0] if minhash_filter else exact_filter
    intermediate = sum(
        f.stat().st_size
        for sub in ("exact-sigs", "exact-dups", "minhash-sigs", "minhash-buckets", "minhash-remove")
        for f in (work / sub).rglob("*")
        if f.is_file()
    )
    print(
        json.dumps(
            {
                "datatrove": metadata.version("datatrove"),
                "seconds": seconds,
                "stage_s": stage_s,
                "driver_cpu_s": own.ru_utime + own.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                "peak_rss_gib": own.ru_maxrss * 1024 / GIB,
                "workers_peak_rss_gib": max(children.ru_maxrss, tree.worker_peak_kib) * 1024 / GIB,
                "tree_peak_rss_gib": tree.tree_peak_kib * 1024 / GIB,
                "source_reads": 3 if config else 2,
                "intermediate_bytes": intermediate,
                "documents_read": reader["documents"].total,
                "duplicates_removed": exact_filter["dropped"].total,
                "near_duplicates_removed": minhash_filter[0]["dropped"].total if minhash_filter else 0,
                "documents_kept": filtered["forwarded"].total,
                "tokens": tokenizer_step["tokens"].total,  # EOS included
            }
        )
    )


def _document_text(doc) -> str:  # ExactDedupConfig hashes what this returns (its annotation says str)
    return doc.text


def child_encode(corpus: str, tokenizer_dir: str, megabytes: float) -> None:
    """The tokenizer library alone: ``encode_batch_fast`` (ids without offsets, what `prepare` calls) over the
    corpus's first ``megabytes`` MB, in batches."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    texts, size = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size >= megabytes * 1e6:
                break
    t0 = time.perf_counter()
    for start in range(0, len(texts), 1024):
        tok.encode_batch_fast(texts[start : start + 1024], add_special_tokens=False)
    print(json.dumps({"seconds": time.perf_counter() - t0, "mb": size / 1e6}))


def datatrove_python() -> str:
    """The interpreter of datatrove's environment, built on first use under ``~/.cache/moe-lab/envs``."""
    tokenizers = metadata.version("tokenizers")
    home = ENVS_ROOT / f"datatrove-{DATATROVE}-tokenizers-{tokenizers}"
    requirements = [*DATATROVE_REQUIREMENTS, f"tokenizers=={tokenizers}"]
    return cached_env(home, requirements, system_site_packages=False)


def datatrove_minhash(threshold: float) -> dict:
    """The lab's MinHash parameters at ``threshold`` (`PrepareConfig`'s defaults, `lsh_params`' bands and rows)
    as datatrove's `MinhashConfig` fields: a band is a bucket, a band's rows its hashes. The hash functions and
    their seeds are each library's own."""
    from moe_core.data.minhash import NearDuplicates
    from moe_core.data.prepare import PrepareConfig

    defaults = PrepareConfig()
    lab = NearDuplicates(threshold, defaults.minhash_num_perm, defaults.minhash_ngram).describe()
    return {"n_grams": lab["ngram"], "num_buckets": lab["bands"], "hashes_per_bucket": lab["rows"]}


def run_child(args: list[str], env: dict[str, str] | None = None, python: str = sys.executable) -> dict:
    done = subprocess.run(
        [python, str(HERE), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "MOE_LAB_PROGRESS": "off", **(env or {})},
    )
    if done.returncode != 0:
        raise SystemExit(f"child {args[:2]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def datatrove_part(args: argparse.Namespace, work: Path) -> dict:
    """The lab's preparation and datatrove's pipeline for the same work on the same corpus (with planted
    duplicates), ``max(--procs)`` processes each, interleaved over ``--rounds``: the lab as ``moe-lab data prepare``
    runs it with the tokenizer it trained in a first run (so neither side trains one; that first run is reported
    apart), locally and on Ray (the cluster started before the clock), and datatrove's stages
    (`child_datatrove`) encoding with the same tokenizer.json, on the corpus cut into ``max(--procs)`` files.
    The lab also does what datatrove's pipeline does not: the validation suite (``lab-no-validation`` leaves it
    out), the train / validation / test split, packing into blocks and checksummed shards."""
    corpus = make_corpus(
        work / f"corpus-{args.procs_mb:g}MB-dup{args.duplicates:g}.jsonl", args.procs_mb, args.duplicates
    )
    actual = corpus.stat().st_size / 1e6
    n = max(args.procs)
    shards = split_corpus(corpus, n, work / f"{corpus.stem}-{n}-files")
    python = datatrove_python()
    near = ["--near-dedup", str(args.near_dedup)] if args.near_dedup else []
    lab = ["--child-prepare", str(corpus)]
    trained = work / "dt-lab-trained"
    first = run_child([*lab, str(trained), "--num-proc", str(n), *near])
    tokenizer = trained / "tokenizer"
    eos = json.loads((tokenizer / "tokenizer_config.json").read_text())["eos_token"]
    given = ["--num-proc", str(n), *near, "--tokenizer", str(tokenizer)]
    runs = {
        "lab": (sys.executable, [*lab, str(work / "dt-lab"), *given]),
        # datatrove's pipeline validates nothing: the lab without its expectation suite, for the like-for-like
        "lab-no-validation": (sys.executable, [*lab, str(work / "dt-lab-nv"), *given, "--no-validate"]),
        "lab-ray": (sys.executable, [*lab, str(work / "dt-lab-ray"), *given, "--engine", "ray"]),
        "datatrove": (
            python,
            ["--child-datatrove", str(shards), str(work / "dt-datatrove"), "--num-proc", str(n)]
            + ["--tokenizer", str(tokenizer / "tokenizer.json"), "--eos", eos]
            + (["--minhash", json.dumps(datatrove_minhash(args.near_dedup))] if args.near_dedup else []),
        ),
    }
    if args.part_mb:
        runs["lab-ray"][1].extend(["--part-mb", str(args.part_mb)])
    seen: dict[str, list[dict]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, (interpreter, child) in runs.items():
            seen[name].append(run_child(child, python=interpreter))
    figures: dict[str, dict] = {"lab-training-its-tokenizer": first}
    for name, figs in seen.items():
        row = dict(figs[-1])  # the counts are the same every round; times and peaks are the median
        for key in ("seconds", "driver_cpu_s", "peak_rss_gib", "workers_peak_rss_gib", "tree_peak_rss_gib"):
            row[key] = statistics.median(f[key] for f in figs)
        figures[name] = row
    for row in figures.values():
        row["mb_per_s"] = actual / row["seconds"]
    dt = figures["datatrove"]
    out = {
        "datatrove_version": dt["datatrove"],
        "processes": n,
        "corpus_mb": round(actual, 2),
        "duplicates": args.duplicates,
        "near_dedup": args.near_dedup,
        "minhash": datatrove_minhash(args.near_dedup) if args.near_dedup else None,
        "runs": {
            k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
            for k, v in figures.items()
        },
        "lab_over_datatrove": {
            name: {
                "seconds": round(figures[name]["seconds"] / dt["seconds"], 3),
                "tree_peak_rss": round(figures[name]["tree_peak_rss_gib"] / dt["tree_peak_rss_gib"], 3),
            }
            for name in ("lab", "lab-no-validation", "lab-ray", "lab-training-its-tokenizer")
        },
    }
    print(f"{actual:.1f} MB, {n} processes, datatrove {dt['datatrove']}:")
    print(
        f"{'':<28}{'s':>8}{'MB/s':>8}{'driver GiB':>12}{'worker GiB':>12}{'tree GiB':>10}"
        f"{'dups':>7}{'near':>7}{'kept':>8}{'tokens':>10}"
    )
    for name, row in figures.items():
        print(
            f"{name:<28}{row['seconds']:>8.1f}{row['mb_per_s']:>8.2f}{row['peak_rss_gib']:>12.2f}"
            f"{row['workers_peak_rss_gib']:>12.2f}{row['tree_peak_rss_gib']:>10.2f}{row['duplicates_removed']:>7}"
            f"{row['near_duplicates_removed']:>7}{row['documents_kept']:>8}{row['tokens']:>10}"
        )
    print(
        "lab / datatrove: "
        + ", ".join(
            f"{k} x{v['seconds']} s, x{v['tree_peak_rss']} peak" for k, v in out["lab_over_datatrove"].items()
        )
    )
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[40, 320, 1000], help="corpus sizes, MB")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--procs-mb",
        type=float,
        default=320,
        help="corpus of the procs part, MB (320: on 40 MB the serial tokenizer-training pass caps 2 processes at 1.4x)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the procs part")
    parser.add_argument(
        "--parts", nargs="+", default=["sizes", "procs"], choices=["sizes", "procs", "engines", "datatrove"]
    )
    parser.add_argument(
        "--part-mb", type=float, default=None, help="engines: the size of a source's parts on Ray, MB"
    )
    parser.add_argument(
        "--near-dedup",
        type=float,
        default=None,
        help="engines, datatrove: MinHash near-deduplication at this threshold",
    )
    parser.add_argument(
        "--duplicates",
        type=float,
        default=0.1,
        help="datatrove: the share of documents followed by a planted copy (half exact, half near)",
    )
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="corpora and outputs (default: a temp dir)"
    )
    parser.add_argument("--child-prepare", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--child-encode", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    parser.add_argument("--child-datatrove", nargs=2, metavar=("SHARDS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--num-proc", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="local", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--eos", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--minhash", type=json.loads, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-validate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_prepare:
        return child_prepare(
            *args.child_prepare,
            args.num_proc,
            args.vocab_size,
            args.engine,
            args.part_mb,
            args.near_dedup,
            args.tokenizer,
            not args.no_validate,
        )
    if args.child_datatrove:
        return child_datatrove(*args.child_datatrove, args.num_proc, args.tokenizer, args.eos, args.minhash)
    if args.child_encode:
        return child_encode(*args.child_encode, args.procs_mb)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="data_prep_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "benchmark": "data_prep",
        "vocab_size": args.vocab_size,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
    }
    try:
        if "sizes" in args.parts:
            sizes = {}
            for mb in args.sizes:
                corpus = make_corpus(work / f"corpus-{mb:g}MB.jsonl", mb)
                actual = corpus.stat().st_size / 1e6
                figures = run_child(["--child-prepare", str(corpus), str(work / f"out-{mb:g}")])
                figures.update(mb=round(actual, 1), s_per_mb=figures["seconds"] / actual)
                sizes[f"{mb:g}"] = {k: round(v, 4) for k, v in figures.items()}
                shutil.rmtree(work / f"out-{mb:g}", ignore_errors=True)
                print(
                    f"{actual:8.1f} MB  peak RSS {figures['peak_rss_gib']:.2f} GiB (workers "
                    f"{figures['workers_peak_rss_gib']:.2f})  {figures['s_per_mb']:.2f} s/MB",
                    flush=True,
                )
            first = sizes[f"{args.sizes[0]:g}"]
            result["sizes"] = sizes
            result["over_smallest"] = {
                k: {
                    "peak_rss": round(v["peak_rss_gib"] / first["peak_rss_gib"], 3),
                    "s_per_mb": round(v["s_per_mb"] / first["s_per_mb"], 3),
                }
                for k, v in sizes.items()
            }
        if "procs" in args.parts:
            corpus = make_corpus(work / f"corpus-{args.procs_mb:g}MB.jsonl", args.procs_mb)
            actual = corpus.stat().st_size / 1e6
            times: dict[int, list[float]] = {n: [] for n in args.procs}
            for _ in range(args.rounds):
                for n in args.procs:
                    out = work / f"procs-{n}"
                    figures = run_child(["--child-prepare", str(corpus), str(out), "--num-proc", str(n)])
                    times[n].append(figures["seconds"])
            encode = run_child(
                ["--child-encode", str(corpus), str(out / "tokenizer"), "--procs-mb", str(args.procs_mb)],
                env={"TOKENIZERS_PARALLELISM": "false"},
            )
            base = statistics.median(times[args.procs[0]])
            result["procs"] = {
                str(n): {
                    "seconds": round(statistics.median(t), 2),
                    "spread": [round(min(t), 2), round(max(t), 2)],
                    "mb_per_s_per_core": round(actual / statistics.median(t) / n, 3),
                    "speedup": round(base / statistics.median(t), 3),
                }
                for n, t in times.items()
            }
            result["tokenizer_encode_batch_mb_per_s_1_thread"] = round(encode["mb"] / encode["seconds"], 3)
            for n, v in result["procs"].items():
                print(
                    f"--num-proc {n}: {v['seconds']:.1f} s, x{v['speedup']:.2f}, {v['mb_per_s_per_core']} MB/s/core"
                )
            print(
                f"tokenizer encode_batch alone, 1 thread: {result['tokenizer_encode_batch_mb_per_s_1_thread']} MB/s"
            )
        if "engines" in args.parts:
            corpus = make_corpus(work / f"corpus-{args.procs_mb:g}MB.jsonl", args.procs_mb)
            actual = corpus.stat().st_size / 1e6
            n = max(args.procs)
            runs = {"local": ["--num-proc", "1"], "ray": ["--num-proc", str(n), "--engine", "ray"]}
            if args.part_mb:
                runs["ray"] += ["--part-mb", str(args.part_mb)]
            if args.near_dedup:
                for extra in runs.values():
                    extra += ["--near-dedup", str(args.near_dedup)]
            result["near_dedup"] = args.near_dedup
            seen: dict[str, list[dict]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for name, extra in runs.items():
                    seen[name].append(run_child(["--child-prepare", str(corpus), str(work / name), *extra]))
            result["engines"] = {
                name: {
                    "seconds": round(statistics.median(f["seconds"] for f in figs), 2),
                    "driver_cpu_s_per_mb": round(
                        statistics.median(f["driver_cpu_s"] for f in figs) / actual, 4
                    ),
                    "ray_start_s": round(statistics.median(f["ray_start_s"] for f in figs), 2),
                }
                for name, figs in seen.items()
            }
            local, ray_ = result["engines"]["local"], result["engines"]["ray"]
            result["engines"]["ray_speedup"] = round(local["seconds"] / ray_["seconds"], 3)
            result["engines"]["driver_cpu_ratio"] = round(
                ray_["driver_cpu_s_per_mb"] / local["driver_cpu_s_per_mb"], 3
            )
            print(
                f"{actual:.1f} MB: local {local['seconds']} s, Ray ({n} CPUs) {ray_['seconds']} s "
                f"(x{result['engines']['ray_speedup']}); the driving process's CPU per MB on Ray "
                f"x{result['engines']['driver_cpu_ratio']} of local's"
            )
        if "datatrove" in args.parts:
            result["datatrove"] = datatrove_part(args, work)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
