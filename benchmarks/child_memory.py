"""One child process of a memory benchmark, watched: its resident set polled from ``/proc/<pid>/status`` every
50 ms while it runs (standard library only: `finetune_scale.py` and `load_published.py` import it in their
children too, under whichever interpreter runs them).

Figures: ``ru_maxrss`` from ``wait4`` (the kernel's peak; on Linux it also counts what this process had resident
when it forked the child, which hides a child smaller than its parent), the child's own high-water mark
(``VmHWM``), the anonymous and file-backed parts (``RssAnon`` / ``RssFile``) at the largest resident set seen, and
the largest anonymous part seen: with a memory-mapped checkpoint larger than free memory, how much of the file
stays mapped at the peak moment is the kernel's page reclaim, so the anonymous peak is what the process itself
needs.

`TreeMemory` watches a process's whole tree from inside it instead (`data_prep.py`'s children: a pool's or a
cluster's workers)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path

GIB = 2**30
POLL_S = 0.05


def proc_status_kib(pid: int | str = "self") -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile (KiB) of a process from /proc/<pid>/status; {} off Linux or once it
    is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    return {k: int(line.split()[1]) for line in lines for k in keys if line.startswith(k + ":")}


def meminfo_kib() -> dict[str, int]:
    """/proc/meminfo's fields (KiB); {} off Linux."""
    try:
        return {
            line.split(":")[0]: int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
        }
    except (OSError, ValueError, IndexError):
        return {}


def machine(packages: tuple[str, ...]) -> dict:
    """What a memory benchmark's figures were taken on, with the versions of ``packages``."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "memory_gib": round(meminfo_kib().get("MemTotal", 0) / 2**20, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        **{name: metadata.version(name) for name in packages},
    }


def descendant_pids(root: int) -> list[int]:
    """The processes now alive below ``root`` (children, their children, ...), from the parent id in every
    ``/proc/<pid>/stat``; [] off Linux."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class TreeMemory:
    """While the ``with`` block runs, a thread samples this process's descendants every ``poll_s``: the
    largest high-water mark (``VmHWM``) of any one of them, and the largest sum of resident sets (``VmRSS``)
    over this process and all of them at one moment. A pool's or a cluster's workers are grandchildren or
    outlive the block (a forkserver's, Ray's), so ``RUSAGE_CHILDREN`` misses them; a process that lives less
    than ``poll_s`` may be missed here."""

    def __init__(self, poll_s: float = 0.1) -> None:
        self.poll_s = poll_s
        self.worker_peak_kib = self.tree_peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        total = proc_status_kib().get("VmRSS", 0)
        for pid in descendant_pids(os.getpid()):
            status = proc_status_kib(pid)
            self.worker_peak_kib = max(self.worker_peak_kib, status.get("VmHWM", 0))
            total += status.get("VmRSS", 0)
        self.tree_peak_kib = max(self.tree_peak_kib, total)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # what is still alive at the end (a cluster's workers)


def watch_child(command: list[str], env: dict[str, str], log_path: Path, max_rss_gib: float | None) -> dict:
    """Run ``command`` (stdout and stderr to ``log_path``), poll its memory until it ends, SIGKILL it once its
    resident set passes ``max_rss_gib``. Returns the figures above, ``wall_s``, ``exit_code`` and, unless it
    exited 0, a ``status`` saying why (with the log's tail for a failure)."""
    started = time.perf_counter()
    peak_sample: dict[str, int] = {}
    peak_anon_kib = 0
    over_limit = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                sample = proc_status_kib(proc.pid)
                if sample.get("VmRSS", 0) > peak_sample.get("VmRSS", -1):
                    peak_sample = sample
                peak_anon_kib = max(peak_anon_kib, sample.get("RssAnon", 0))
                if max_rss_gib and sample.get("VmRSS", 0) > max_rss_gib * GIB / 1024 and not over_limit:
                    over_limit = True
                    os.kill(proc.pid, signal.SIGKILL)
                time.sleep(POLL_S)
        except BaseException:  # Ctrl-C or an error here: the child does not outlive the benchmark
            proc.kill()
            proc.wait()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    row: dict = {
        "wall_s": time.perf_counter() - started,
        "exit_code": proc.returncode,
        "ru_maxrss_gib": usage.ru_maxrss * 1024 / GIB,  # KiB on Linux
        "vm_hwm_gib": peak_sample.get("VmHWM", 0) * 1024 / GIB,
        "rss_anon_gib_at_peak": peak_sample.get("RssAnon", 0) * 1024 / GIB,
        "rss_file_gib_at_peak": peak_sample.get("RssFile", 0) * 1024 / GIB,
        "peak_anon_gib": peak_anon_kib * 1024 / GIB,
    }
    if proc.returncode == 0:
        return row
    if over_limit:
        row["status"] = f"stopped: resident set over --max-rss-gib {max_rss_gib}"
    elif proc.returncode == -signal.SIGKILL:
        row["status"] = "killed (SIGKILL: out of memory?)"
    else:
        row["status"] = f"failed (exit {proc.returncode})"
        row["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return row
