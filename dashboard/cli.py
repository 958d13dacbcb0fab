"""`moe-lab dashboard`: the live web dashboard for training, routing and inference runs.

    moe-lab dashboard                                   # runs under $MOE_LAB_HOME/runs (./.moe_lab/runs)
    moe-lab dashboard --runs runs/ --runs /data/exp     # more runs roots (any --out directory)
    moe-lab dashboard --mlflow sqlite:///.moe_lab/mlflow.db
    moe-lab dashboard --host 0.0.0.0 --token SECRET     # another host needs a token (or $MOE_LAB_DASHBOARD_TOKEN)
    moe-lab train --out runs/a --dashboard              # start it beside a training run

It binds 127.0.0.1 by default and is read-only. On another host every request must carry the token.
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import gc
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from moe_core.errors import MoELabError

DEFAULT_PORT = 8765
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class DashboardError(MoELabError):
    """The dashboard cannot start as asked (a non-local host without a token, no free port, ...)."""


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "dashboard",
        help="live web dashboard: training, routing, compare, inference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--runs",
        action="append",
        default=[],
        metavar="DIR",
        help="a runs root (repeatable); default $MOE_LAB_HOME/runs",
    )
    p.add_argument(
        "--mlflow", default=None, metavar="URI", help="also list this MLflow tracking store's runs"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free)"
    )
    p.add_argument(
        "--token", default=None, help="required on a non-local --host; default $MOE_LAB_DASHBOARD_TOKEN"
    )
    p.set_defaults(func=run_dashboard)


def default_roots() -> list[str]:
    from tasks.settings import runs_dir

    return [str(runs_dir())]


def resolve_token(host: str, token: str | None) -> str | None:
    from dashboard.server import TOKEN_ENV

    token = token or os.environ.get(TOKEN_ENV) or None
    if host not in LOCAL_HOSTS and not token:
        raise DashboardError(
            f"--host {host} exposes the dashboard beyond this machine: pass --token SECRET or set {TOKEN_ENV}"
        )
    return token


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dashboard_url(host: str, port: int, token: str | None = None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def run_dashboard(args) -> int:
    import uvicorn

    from dashboard.server import create_app

    token = resolve_token(args.host, args.token)
    roots = args.runs or default_roots()
    port = args.port or free_port(args.host)
    app = create_app(roots, token=token, mlflow_uri=args.mlflow)
    print(
        f"moe-lab dashboard: {dashboard_url(args.host, port, token)} (runs: {', '.join(roots)})", flush=True
    )
    # the ~0.5M objects of the libraries imported so far (torch, transformers) live as long as the server: kept
    # out of the collector's full passes, which would walk them all while every live stream waits
    gc.freeze()
    # a live stream never ends by itself: without a grace limit, SIGTERM or Ctrl-C with a page open would
    # wait for the page to close
    uvicorn.run(app, host=args.host, port=port, log_level="warning", timeout_graceful_shutdown=1)
    return 0


def add_dashboard_option(parser, help: str, func) -> None:
    """``--dashboard`` on another command's parser (``moe-lab train``, ``moe-lab run``), handled by ``func``."""
    parser.add_argument("--dashboard", action="store_true", help=help)
    parser.set_defaults(func=func)


def start_beside(
    roots: list[str | Path],
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    wait_s: float = 90.0,
) -> tuple[subprocess.Popen, str]:
    """Start the dashboard in a child process (beside a training run or a flow); returns it and its URL once
    it answers. The caller terminates it (or leaves it running for the user)."""
    token = resolve_token(host, token)
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "dashboard.cli", "--host", host, "--port", str(port)]  # skips the dispatcher
    for root in roots:
        cmd += ["--runs", str(root)]
    env = dict(os.environ)
    if token:
        env["MOE_LAB_DASHBOARD_TOKEN"] = token
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = dashboard_url(host, port, token)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DashboardError(
                f"the dashboard exited with code {proc.returncode} before answering on {url}"
            )
        try:
            req = urllib.request.Request(
                url.split("?")[0] + "api/runs", headers={"Authorization": f"Bearer {token}"} if token else {}
            )
            with urllib.request.urlopen(req, timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise DashboardError(f"the dashboard did not answer on {url} within {wait_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """``python -m dashboard.cli``: the ``moe-lab dashboard`` command alone (a faster start beside a job)."""
    parser = argparse.ArgumentParser(prog="moe-lab")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dashboard", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except MoELabError as err:
        print(f"moe-lab dashboard: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
