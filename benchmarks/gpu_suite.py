"""One command that checks and measures the lab on a GPU: for the rare half hour one is at hand.

    python benchmarks/gpu_suite.py                 # on a CUDA machine: the checks, then the measurements
    python benchmarks/gpu_suite.py --dry-run       # the same code paths on the CPU at tiny shapes (CI runs it)
    python benchmarks/gpu_suite.py --skip-checks --only moe_layer,decode

1. Checks: the GPU-marked tests (`tests/test_gpu.py`: every expert path against the reference in fp32 and bf16,
   forward and backward, grouped_mm where the device has it, the router's fp32 logits under autocast, the
   compiled decode against eager, quantized experts on the device, a save/resume round trip on the device).
2. Measurements, each against its baseline in the same run:
   - moe_layer: one MoE layer's forward + backward (bf16) against the dense FFN of equal active size and
     transformers' Mixtral block holding the same weights, at OLMoE-1B-7B's and Mixtral-8x7B's shapes, 16k tokens
     (`benchmarks/moe_layer.py`);
   - train: a training step's tokens/s, MFU and peak memory for the olmoe-base preset and an OLMoE-1B-7B-shaped
     model cut to 2 layers, each against its dense-active baseline;
   - decode: batch-1 and batch-32 greedy decoding, the compiled static-cache decode against transformers'
     ``generate`` on the same model;
   - finetune, qlora: LoRA and QLoRA (nf4) steps at OLMoE-1B-7B's full size against transformers + PEFT on the same
     tokens (`benchmarks/finetune_scale.py` in a child, its random-weight stand-in written first: 13 GiB of
     disk), each variant's step time and peak CUDA memory, and one more step profiled per variant (its kernels by
     device time, in ``--out``'s ``*-profiles/``);
   - peak CUDA memory of each.
3. One table and one JSON line, printed and written to ``--out`` (default ``runs/gpu_suite/``); the JSON file is
   rewritten after every section, so a run stopped at its time limit keeps what it measured.

A package the machine lacks is named with the command that installs it, and its sections are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/moe_layer.py

import moe_layer  # noqa: E402
from finetune_scale import RESULT_PREFIX  # noqa: E402

NEEDED = ("transformers", "safetensors", "peft", "pytest")
INSTALL = "pip install -c constraints.txt -e '.[test]'"

# (name, D, F, E, K): the MoE layer shapes measured
LAYER_SHAPES = [("olmoe-1b-7b", 2048, 1024, 64, 8), ("mixtral-8x7b", 4096, 14336, 8, 2)]
DRY_LAYER_SHAPES = [("tiny", 64, 128, 8, 2)]
CHECKS_TIMEOUT_S = (
    300  # a hung check must not eat the half hour: pytest is stopped and the measurements go on
)
TABLE_KEYS = ("status", "step_s", "tokens_per_s", "cuda_peak_gib", "peak_rss_gib", "load_s")


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "cuda": torch.version.cuda}
    if device.type == "cuda":
        env.update(
            name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1),
        )
    env["missing"] = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    return env


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ 1. checks
def checks(dry_run: bool) -> dict:
    """tests/test_gpu.py in a child pytest; the outcome of each test."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if dry_run:
        env.update(MOE_LAB_TEST_DEVICE="cpu", MOE_LAB_TEST_COMPILE_BACKEND="aot_eager")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    # one process: pyproject's -n auto would start up to five workers on the one GPU, each with
                    # its own CUDA context and inductor compiles (on the H100 of 2026-11-27, 15 checks in 131 s
                    # against all 23 in 89 s with -n 0)
                    "-n",
                    "0",
                    "tests/test_gpu.py",
                    f"--junitxml={report}",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=CHECKS_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"pytest stopped after {CHECKS_TIMEOUT_S} s", "seconds": CHECKS_TIMEOUT_S}
        seconds = time.perf_counter() - start
        if not report.is_file():
            return {"error": "pytest wrote no report (is pytest installed?)", "seconds": round(seconds, 1)}
        cases = ET.parse(report).getroot().iter("testcase")
        outcome, messages = {}, {}
        for case in cases:
            status = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    status = child.tag
                if child.tag in ("failure", "error"):  # what a GPU session needs to fix it afterwards
                    messages[case.get("name")] = ((child.get("message") or "") + "\n" + (child.text or ""))[
                        -1500:
                    ]
            outcome[case.get("name")] = status
    counts = {s: sum(v == s for v in outcome.values()) for s in ("passed", "failure", "error", "skipped")}
    return {
        "counts": counts,
        "failed": sorted(k for k, v in outcome.items() if v in ("failure", "error")),
        "messages": messages,
        "skipped": sorted(k for k, v in outcome.items() if v == "skipped"),
        "seconds": round(seconds, 1),
    }


# ------------------------------------------------------------------------------------------------ 2. measurements
def measure_moe_layer(device: torch.device, dry_run: bool) -> dict:
    results = {}
    for name, D, F_, E, K in DRY_LAYER_SHAPES if dry_run else LAYER_SHAPES:
        args = moe_layer.parser().parse_args([])
        args.hidden, args.ffn, args.experts, args.top_k = D, F_, E, K
        args.batch, args.seq = (1, 64) if dry_run else (4, 4096)  # 16k tokens on a GPU
        args.rounds, args.warmup = (1, 1) if dry_run else (10, 3)
        args.device, args.dtype = str(device), "float32" if dry_run else "bfloat16"
        args.impls = (
            "sorted,grouped_mm"
            if device.type == "cpu" or torch.cuda.get_device_capability(device) >= (9, 0)
            else "sorted"
        )
        results[name] = moe_layer.measure(args)
    return results


def measure_train(device: torch.device, dry_run: bool, workdir: Path) -> dict:
    """tokens/s, MFU and peak memory of training steps, each model against its dense-active baseline."""
    from moe_core.train import TrainConfig, read_jsonl, train

    models = {
        "olmoe-base": {"preset": "olmoe-base"},
        "olmoe-1b-7b-2L": {
            "preset": "olmoe-base",
            "overrides": {
                "hidden_size": 2048,
                "expert_intermediate_size": 1024,
                "num_experts": 64,
                "num_experts_per_tok": 8,
                "num_hidden_layers": 2,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "vocab_size": 50304,
            },
        },
    }
    if dry_run:  # the real-size configs are still built and checked, then a tiny one trains
        for model in models.values():
            TrainConfig.build({"model": model}).model.build_config()
        models = {"olmoe-tiny": {"preset": "olmoe-tiny"}}
    steps = 3 if dry_run else 12
    results = {}
    for name, model in models.items():
        for variant in ("moe", "dense-active"):
            section = {**model, **({"baseline": "active"} if variant == "dense-active" else {})}
            config = TrainConfig.build(
                {
                    "model": section,
                    "steps": steps,
                    "batch_size": 2 if dry_run else 8,
                    "precision": "fp32" if dry_run else "bf16",
                    "device": device.type,
                    "data": {
                        "source": "synthetic",
                        "seq_len": 32 if dry_run else 2048,
                        "synthetic_blocks": 64,
                    },
                    "log": {"every": 1, "progress": "off"},
                    "checkpoint": {"every": 10**6, "export": False},
                    "eval": {"batches": 1},
                }
            )
            out = workdir / f"train-{name}-{variant}"
            train(config, out)
            rows = [r for r in read_jsonl(out / "metrics.jsonl") if "tokens_per_s" in r][
                1:
            ]  # past compile/warm-up
            results[f"{name}/{variant}"] = {
                "tokens_per_s": round(sum(r["tokens_per_s"] for r in rows) / max(len(rows), 1), 1),
                "mfu": rows[-1].get("mfu") if rows else None,
                "max_memory_mb": rows[-1].get("max_memory_mb") if rows else None,
            }
        moe, dense = results[f"{name}/moe"], results[f"{name}/dense-active"]
        moe["vs_dense_active"] = (
            round(moe["tokens_per_s"] / dense["tokens_per_s"], 4) if dense["tokens_per_s"] else None
        )
    return results


def measure_finetune(
    device: torch.device,
    dry_run: bool,
    workdir: Path,
    timeout_s: float,
    variants: tuple[str, ...],
    profile_dir: Path,
) -> dict:
    """benchmarks/finetune_scale.py in a child, for ``variants`` (its stand-in checkpoint is written once into
    ``workdir`` and shared by the calls): its JSON line, or what stopped it. Each variant's profiled step
    (``--profile``: one more step, untimed) goes to ``profile_dir``, so a gap can be read without a second lease."""
    if dry_run:
        size = ["--tiny", "--steps", "1", "--warmup", "0", "--lab-set=quantize.group_size=16"]
    else:
        size = ["--model", "olmoe-1b-7b", "--batch", "4", "--seq", "512", "--steps", "5", "--warmup", "2"]
    qlora = [f"--qlora={v.rsplit('-', 1)[1]}" for v in variants if v.startswith("lab-qlora-")]
    command = [sys.executable, str(ROOT / "benchmarks" / "finetune_scale.py"), *size, *qlora]
    command += [f"--only={v}" for v in variants]
    command += ["--device", device.type, "--cache-dir", str(workdir / "published")]
    command += ["--profile", str(profile_dir)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        tail = err.stdout or b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        finished = [line for line in tail.splitlines() if line.startswith(RESULT_PREFIX)]
        results = {k: v for line in finished for k, v in json.loads(line[len(RESULT_PREFIX) :]).items()}
        return {"error": f"stopped after {timeout_s:.0f} s", "results": results, "tail": tail[-2000:]}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return {"error": f"exit {done.returncode}", "tail": (done.stdout + done.stderr)[-2000:]}
    figures = json.loads(lines[-1])
    if any(row.get("status") != "ok" for row in figures["results"].values()):
        figures["printed"] = "\n".join(lines[:-1])[-3000:]  # the child's table, with a failed variant's log
    figures["seconds"] = round(time.perf_counter() - start, 1)
    return figures


@torch.no_grad()
def measure_decode(device: torch.device, dry_run: bool) -> dict:
    """Greedy decoding tokens/s: the compiled static-cache steps against transformers' generate, same model."""
    from moe_core import MoEForCausalLM, get_config
    from moe_core.inference.compile import compile_steps

    preset = "olmoe-tiny" if dry_run else "olmoe-base"
    dtype = torch.float32 if dry_run else torch.bfloat16
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config(preset)).to(device=device, dtype=dtype).eval()
    new_tokens, prompt_len = (4, 8) if dry_run else (128, 32)
    backend = "aot_eager" if dry_run else "inductor"
    results = {}
    for batch in (1, 32):
        prompt = torch.randint(2, model.config.vocab_size, (batch, prompt_len), device=device)
        steps = compile_steps(
            model, backend=backend, cache="static", max_cache_len=prompt_len + new_tokens + 1
        )

        def ours(steps=steps, prompt=prompt):
            logits, state = steps.prefill(prompt)
            for _ in range(new_tokens):
                logits, state = steps.decode(logits.argmax(-1, keepdim=True), state)

        def hf(prompt=prompt):
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

        figures = {}
        for name, run in (("compiled", ours), ("transformers-generate", hf)):
            run()  # compile / warm up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            seconds = time.perf_counter() - start
            figures[name] = {"tokens_per_s": round(batch * new_tokens / seconds, 1)}
            if device.type == "cuda":
                figures[name]["peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        figures["speedup"] = round(
            figures["compiled"]["tokens_per_s"] / figures["transformers-generate"]["tokens_per_s"], 3
        )
        results[f"batch{batch}"] = figures
    return results


# ------------------------------------------------------------------------------------------------ 3. report
def table(result: dict) -> str:
    lines = [
        f"GPU suite on {result['environment'].get('name', result['environment']['device'])} "
        f"(torch {result['environment']['torch']}, {'dry run' if result['dry_run'] else 'full'})"
    ]
    checked = result.get("checks")
    if checked:
        lines.append(
            f"checks: {checked.get('counts')} in {checked.get('seconds')} s; failed: {checked.get('failed') or 'none'}"
        )
    for name, r in result.get("moe_layer", {}).items():
        lines.append(
            f"moe_layer {name}: "
            + ", ".join(f"{k} {v:.3f}x" for k, v in r["ratio_vs_dense_active"].items())
            + f" of dense-active time; ours/hf {r['ours_vs_hf']}"
        )
    for name, r in result.get("train", {}).items():
        lines.append(
            f"train {name}: {r['tokens_per_s']} tokens/s, mfu {r['mfu']}, max memory {r['max_memory_mb']} MB"
            + (f", {r['vs_dense_active']}x dense-active" if "vs_dense_active" in r else "")
        )
    for name, r in result.get("decode", {}).items():
        lines.append(
            f"decode {name}: compiled {r['compiled']['tokens_per_s']} tokens/s, transformers generate "
            f"{r['transformers-generate']['tokens_per_s']} ({r['speedup']}x)"
        )
    for section in ("finetune", "qlora"):
        figures = result.get(section)
        if figures and "error" in figures:
            lines.append(f"{section}: {figures['error']}")
        for name, row in (figures or {}).get("results", {}).items():
            cells = ", ".join(f"{k} {v}" for k, v in row.items() if k in TABLE_KEYS)
            lines.append(
                f"{section} {name}: {cells}" + (f"; {row['log_tail'][-300:]}" if "log_tail" in row else "")
            )
        if figures and figures.get("lab_over_baseline"):
            lines.append(f"{section} lab over baseline: {figures['lab_over_baseline']}")
    for name, why in result.get("not_measured", {}).items():
        lines.append(f"not measured: {name}: {why}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU: the code paths, not figures"
    )
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument(
        "--only",
        default="moe_layer,train,finetune,decode,qlora",
        help="measurements to run, in this order (comma-separated)",
    )
    parser.add_argument(
        "--finetune-timeout", type=float, default=900, help="seconds before the finetune child is stopped"
    )
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_suite"))
    args = parser.parse_args()

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_suite: no CUDA device here; run it on a GPU machine, or --dry-run for the code paths",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    started = time.perf_counter()
    result = {
        "benchmark": "gpu_suite",
        "dry_run": args.dry_run,
        "date": datetime.date.today().isoformat(),
        "environment": environment(device),
    }
    missing = result["environment"]["missing"]
    if missing:
        print(f"gpu_suite: missing {', '.join(missing)}: {INSTALL}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['date']}-{'dry-run' if args.dry_run else result['environment'].get('name', 'cuda').replace(' ', '_')}"

    def save() -> str:  # after every section: a run stopped at its limit keeps what it measured
        result["seconds"] = round(time.perf_counter() - started, 1)
        text = table(result)
        for suffix, content in ((".txt", text + "\n"), (".json", json.dumps(result) + "\n")):
            partial = out / f".{stem}{suffix}.partial"
            partial.write_text(content)
            partial.replace(out / f"{stem}{suffix}")
        return text

    if not args.skip_checks:
        result["checks"] = checks(args.dry_run)
        print(save().splitlines()[1], flush=True)
    profiles = out / f"{stem}-profiles"  # the fine-tuning sections' profiled steps
    sections = {
        "moe_layer": lambda workdir: measure_moe_layer(device, args.dry_run),
        "train": lambda workdir: measure_train(device, args.dry_run, workdir),
        "decode": lambda workdir: measure_decode(device, args.dry_run),
        "finetune": lambda workdir: measure_finetune(
            device, args.dry_run, workdir, args.finetune_timeout, ("baseline", "lab"), profiles
        ),
        "qlora": lambda workdir: measure_finetune(
            device, args.dry_run, workdir, args.finetune_timeout, ("lab-qlora-nf4",), profiles
        ),
    }
    wanted = [w for w in args.only.split(",") if w]
    unknown = sorted(set(wanted) - set(sections))
    if unknown:
        parser.error(f"--only {unknown}: choose from {', '.join(sections)}")
    with tempfile.TemporaryDirectory() as workdir:
        for name in wanted:
            result[name] = sections[name](Path(workdir))
            print(f"{name}: done at {time.perf_counter() - started:.0f} s", flush=True)
            save()
    text = save()
    print(text)
    print(json.dumps(result))
    failed = (result.get("checks") or {}).get("failed")
    return 1 if failed or (result.get("checks") or {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
