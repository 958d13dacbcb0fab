"""Data preparation at scale (issue 34 §3): peak memory and seconds per MB as the corpus grows, `--num-proc`
scaling, and the tokenizer library's own batch throughput, measured in one run.

Corpora: jsonl files of unique documents, each a header line ("document N: <stdlib file>:<line>") followed by a
run of 20-80 lines of the running interpreter's standard library (cycled for large sizes), written once per
size under ``--work-dir`` (reused when present).

Parts (each preparation runs in a child process of its own, one at a time: ``moe-lab data prepare`` as a user
runs it, with ``--vocab-size 4000`` and validation on):
  sizes    one preparation per ``--sizes`` (MB): the child's peak resident set (``ru_maxrss``, the reader's
           process) and its workers' (``RUSAGE_CHILDREN``), seconds per MB; ratios against the smallest size
           (targets: peak RSS at 320 MB within 1.3x of 40 MB's, s/MB within 1.25x)
  procs    the ``--procs-mb`` corpus prepared with each ``--procs`` value, interleaved over ``--rounds`` rounds
           (target: 2 processes >= 1.7x faster than 1 on 2 idle cores), MB/s per core; beside it the
           tokenizer's own ``encode_batch`` on the same text with one thread (``TOKENIZERS_PARALLELISM=false``),
           the bound of the tokenize stage per core
  engines  the ``--procs-mb`` corpus prepared by one local process and on a local Ray cluster of
           ``max(--procs)`` CPUs (started before the clock; parts of ``--part-mb``), interleaved: seconds, and
           the driving process's own CPU per MB (what bounds a cluster run when the driver reads and scans)

    python benchmarks/data_prep.py                                  # sizes 40 320 1000, procs 1 2 on 320 MB
    python benchmarks/data_prep.py --sizes 40 320 --parts sizes     # memory figures only
    python benchmarks/data_prep.py --parts engines --procs-mb 40 --part-mb 8 --near-dedup 0.8   # local vs Ray

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

GIB = 2**30
HERE = Path(__file__).resolve()


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


def make_corpus(path: Path, megabytes: float) -> Path:
    """A jsonl file of about ``megabytes`` MB of unique documents (see the module docstring)."""
    if path.is_file():
        return path
    import random

    rng = random.Random(0)
    target = int(megabytes * 1e6)
    lines = _stdlib_lines()
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        i = 0
        while written < target:
            rel, n, first = next(lines)
            body = [first] + [next(lines)[2] for _ in range(rng.randint(20, 80))]
            row = json.dumps({"text": f"document {i}: {rel}:{n}\n" + "\n".join(body)}) + "\n"
            f.write(row)
            written += len(row.encode())
            i += 1
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------- children
def child_prepare(
    corpus: str,
    out: str,
    num_proc: int,
    vocab_size: int,
    engine: str = "local",
    part_mb: float | None = None,
    near_dedup: float | None = None,
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
        source=corpus, vocab_size=vocab_size, num_proc=num_proc, engine=engine, near_dedup=near_dedup
    )
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    prepare(config, out, overwrite=True)
    seconds = time.perf_counter() - t0
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "driver_cpu_s": own.ru_utime + own.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                "ray_start_s": ray_start,
                "peak_rss_gib": own.ru_maxrss * 1024 / GIB,  # KiB on Linux
                "workers_peak_rss_gib": children.ru_maxrss * 1024 / GIB,
            }
        )
    )


def child_encode(corpus: str, tokenizer_dir: str, megabytes: float) -> None:
    """The tokenizer library alone: ``encode_batch`` over the corpus's first ``megabytes`` MB, in batches."""
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
        tok.encode_batch(texts[start : start + 1024], add_special_tokens=False)
    print(json.dumps({"seconds": time.perf_counter() - t0, "mb": size / 1e6}))


def run_child(args: list[str], env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, str(HERE), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "MOE_LAB_PROGRESS": "off", **(env or {})},
    )
    if done.returncode != 0:
        raise SystemExit(f"child {args[:2]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
        "--parts", nargs="+", default=["sizes", "procs"], choices=["sizes", "procs", "engines"]
    )
    parser.add_argument(
        "--part-mb", type=float, default=None, help="engines: the size of a source's parts on Ray, MB"
    )
    parser.add_argument(
        "--near-dedup", type=float, default=None, help="engines: MinHash near-deduplication at this threshold"
    )
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="corpora and outputs (default: a temp dir)"
    )
    parser.add_argument("--child-prepare", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--child-encode", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    parser.add_argument("--num-proc", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="local", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_prepare:
        return child_prepare(
            *args.child_prepare, args.num_proc, args.vocab_size, args.engine, args.part_mb, args.near_dedup
        )
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
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
