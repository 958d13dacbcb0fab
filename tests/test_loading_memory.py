"""A Hugging Face checkpoint copied into memory by `moe_core.load` costs its bytes once (issue 32 §4): the safetensors
files are read through memory maps, and a copying loader that kept every file mapped to the end of the load held
the checkpoint's bytes a second time, as file-backed resident pages (2x the bytes at the peak, measured at full
width by benchmarks/load_published.py). Measured here in a child process on a ~230 MB tiny-width checkpoint, with
`RELEASE_EVERY_BYTES` well below it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_core.convert import RELEASE_EVERY_BYTES
from moe_core.published import PUBLISHED, build_published

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import moe_core

    def status():
        lines = Path("/proc/self/status").read_text().splitlines()
        return {k: int(l.split()[1]) * 1024 for l in lines for k in ("VmHWM", "VmRSS") if l.startswith(k + ":")}

    moe_core.load(sys.argv[2], dtype=torch.bfloat16)  # a tiny load first: every lazy import is paid before
    before = status()["VmRSS"]
    loaded = moe_core.load(sys.argv[1], dtype=torch.bfloat16)
    after = status()
    print(json.dumps({"before": before, "hwm": after["VmHWM"], "after": after["VmRSS"]}))
    """
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = tmp_path_factory.mktemp("published")
    tiny = PUBLISHED["olmoe-1b-7b"].tiny_overrides
    # ~230 MB of bf16: 2 layers of 16 experts at width 1024 x 768, a 16k vocabulary
    wide = {**tiny, "hidden_size": 1024, "intermediate_size": 768, "num_experts": 16, "vocab_size": 16384}
    big = build_published("olmoe-1b-7b", layers=2, overrides=wide, cache_dir=cache, tokenizer_vocab=300)
    small = build_published("olmoe-1b-7b", layers=1, overrides=tiny, cache_dir=cache, tokenizer_vocab=300)
    return big, small


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_copied_load_holds_the_checkpoint_once_not_twice(checkpoints):
    big, small = checkpoints
    size = json.loads((big / "published.json").read_text())["bytes"]
    assert size > 2.5 * RELEASE_EVERY_BYTES  # a load that kept its file mapped would show it
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(big), str(small)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    grew = (memory["hwm"] - memory["before"]) / size
    # the model's bytes, one mapped window of the file and one tensor in flight; kept mapped, it was ~2.0
    assert grew < 1.0 + (RELEASE_EVERY_BYTES + 48 * 2**20) / size, grew
    assert memory["after"] - memory["before"] >= 0.9 * size  # the weights are in memory (copied, not mapped)
