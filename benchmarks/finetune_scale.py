"""Fine-tuning at published sizes: the lab's LoRA step against transformers + PEFT, side by side (issue 31 §4).

For one published MoE architecture (``--model``, optionally cut to its first ``--layers``), the checkpoint is a
random-weight stand-in with the published config (`moe_core.published.build_published`: sharded bf16
safetensors and a small tokenizer with a chat template, cached under ``~/.cache/moe-lab/published``; nothing
is downloaded). Each variant then runs in a child process of its own, one after the other (never two at
once), on the same tokens (at each step the next ``--batch`` x ``--seq`` tokens of ``examples/sft.jsonl``
framed by the tokenizer's chat template, labels = inputs: new data every step, as a fine-tune reads it), with
the same LoRA (r 8, alpha 16, no dropout, on q/k/v/o and on every expert's gate/up/down projections;
Qwen2-MoE's shared expert is not adapted, as the lab's default), AdamW with the same hyperparameters (lr 1e-4,
LoRA parameters only; each side's own: torch's for the baseline, the lab's trainer's `ExpertAdamW` for the lab,
which steps each expert of a stacked factor as torch's AdamW steps a per-expert module) and gradient clipping at
1.0:

- ``baseline``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16)`` + PEFT ``get_peft_model`` with
  ``target_modules`` naming the attention projections and every per-expert ``nn.Linear`` (transformers 4.57's
  layout; ``--baseline-env transformers4`` builds and caches an environment pinned to it, ``--baseline-python``
  runs it under any other interpreter); under transformers 5, the attention projections and the fused experts (``target_parameters``: gate_up_proj,
  down_proj), as a user of 5.x writes it.
- ``lab``: the lab's own fine-tuning path up to the optimizer: ``moe_core.finetune.run.load_inputs`` (the
  checks, the base model through ``moe_core.load``, in bf16, memory-mapped from the safetensors shards as the
  baseline's is: ``model.mmap`` unset maps a frozen base stored in the training dtype, `moe_core.mapped`) and
  ``select_parameters`` (``apply_method``: the lab's LoRA on attention and the stacked experts), from a
  `FinetuneConfig` (``--lab-set`` adds ``--set``-style fields), and the optimizer its trainer builds
  (``optim.idle_experts``). The steps are the same hand-written loop as the baseline's, not TRL's trainer, so
  both measure the same thing: the lab's objective adds its router losses
  (the published configs' ``output_router_logits`` is false, so the baseline's has none), and the routing
  statistics the lab's trainer logs are not computed.
- ``lab-qlora-int4`` / ``lab-qlora-nf4`` (``--qlora``) and ``lab-copy`` (``--copy``): the lab with
  ``quantize.base=...`` / ``model.mmap=false`` (the base copied into memory); ``--qlora int4-experts`` (or
  ``nf4-experts``) adds ``quantize.attention=false`` (the attention in the model's dtype, the only form before
  version-2 fine-tuning configs), ``-attn`` ``true`` (the default since); "not available yet" while
  `FinetuneConfig` refuses a field.

A step is forward + backward + clip + optimizer step + zero_grad; model load and wrapping are timed apart.
``--generate N``: after its steps each lab variant decodes N greedy tokens with its adapter on the base it trained
on (QLoRA: the 4-bit experts, unmerged, which is what `moe_core.load(OUT)` rebuilds from a QLoRA output).
``--dtype float32`` runs both sides in float32 (on CPUs without AVX-512 BF16, torch's bf16 product in the
layout of a frozen ``Linear``'s backward is the step's bulk: see benchmarks/README.md).
``--profile DIR``: after its timed steps each variant runs one more step (the first batch again, untimed) under
torch.profiler, and its operators, the most expensive first (self device time on CUDA), go to
``DIR/VARIANT.profile.txt``: where a gap between two variants comes from.
The first ``--warmup`` steps are left out of the median. Memory per child: the peak resident set from the
kernel (``wait4``'s ``ru_maxrss``), and, from ``/proc/<pid>/status`` polled every 50 ms, the anonymous and
file-backed parts (``RssAnon`` / ``RssFile``) at the largest resident set seen: memory-mapped weights count as
file-backed, and the largest anonymous part seen (``peak_anon_gib``). Where the weights are memory-mapped and
larger than free memory, how much of a file stays mapped is the kernel's page reclaim, not the program: the
anonymous peak is what the process itself needs. ``--max-rss-gib`` stops a child that grows past it (a shared machine). With ``--device cuda`` the
device's peak allocation is reported too.

Prints a table, then ONE JSON line: each variant's figures, ``lab_over_baseline`` (step time and peak RSS
ratios) and the machine.

    python benchmarks/finetune_scale.py --model olmoe-1b-7b --layers 2              # ~2.5 GiB checkpoint
    python benchmarks/finetune_scale.py --model olmoe-1b-7b --baseline-env transformers4   # full size: alone
    python benchmarks/finetune_scale.py --model qwen1.5-moe-a2.7b --qlora int4      # 26.7 GiB: alone, with disk
    python benchmarks/finetune_scale.py --tiny                                      # shrunken config, seconds
    python benchmarks/finetune_scale.py --narrow --threads 1  # published counts, tiny widths: the host's cost
    python benchmarks/finetune_scale.py --model mixtral-8x7b --build-only           # only write the stand-in
    python benchmarks/finetune_scale.py --model qwen3-30b-a3b --layers 4            # Qwen3-30B-A3B's shape, 4 layers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when loaded from its path
import child_memory  # noqa: E402
from child_memory import GIB, proc_status_kib, watch_child  # noqa: E402
from envs import cached_env  # noqa: E402

# Only the standard library at the top: this file is also the children's program, and the baseline child may
# run under another interpreter (--baseline-python: an environment pinned to another transformers) where only
# torch, transformers and peft exist. torch and the lab are imported inside the functions that use them.

REPO = Path(__file__).resolve().parents[1]
SFT_DATA = REPO / "examples" / "sft.jsonl"
RESULT_PREFIX = "variant result: "  # one stdout line per finished variant (gpu_suite.py reads them)
LORA_R, LORA_ALPHA, LR, CLIP = 8, 16.0, 1e-4, 1.0
TINY_TOKENIZER_VOCAB = 400
# the config fields --narrow keeps at their published values: what sets how many operators a step dispatches
COUNT_FIELDS = {"num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok"}
PROFILE_ROWS = 40  # operators per --profile table
# the lab's config fields issue 31 names for the optional variants
QLORA_FIELD, MMAP_FIELD = "quantize.base", "model.mmap"


# ================================================================================================ the children
def timed_steps(model, spec: dict, optimizer_cls=None, **optimizer_kwargs) -> dict:
    """The benchmark's step, the same for every variant: forward with labels = inputs, backward, clip, AdamW on
    the trainable parameters (``optimizer_cls``: the side's own AdamW, torch's by default), zero_grad. Returns
    per-step seconds and losses."""
    import torch

    device = torch.device(spec["device"])
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = (optimizer_cls or torch.optim.AdamW)(params, lr=LR, weight_decay=0.0, **optimizer_kwargs)
    batches = [torch.tensor(rows, dtype=torch.long, device=device) for rows in spec["tokens"]]
    model.train()
    seconds, losses, anon_gib = [], [], []
    timed = spec["warmup"] + spec["steps"]
    profiled = bool(spec.get("profile_path"))
    for step in range(timed + profiled):  # --profile: one more step, untimed, under the profiler
        input_ids = batches[step % len(batches)]
        profiler = step_profiler(device) if step == timed else None
        t0 = time.perf_counter()
        with profiler or contextlib.nullcontext():
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
        if profiler is not None:
            write_profile(profiler, device, Path(spec["profile_path"]))
            break
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        anon_gib.append(proc_status_kib().get("RssAnon", 0) / 2**20)
        print(
            f"step {len(seconds)}/{timed}: {seconds[-1]:.2f} s, anonymous {anon_gib[-1]:.2f} GiB", flush=True
        )
    # trainable elements with AdamW moments (the lab's ExpertAdamW keeps a stack's per expert, under "experts")
    with_state = sum(
        moments["exp_avg"].numel()
        for state in optimizer.state.values()
        for moments in [state, *state.get("experts", {}).values()]
        if "exp_avg" in moments
    )
    return {
        "torch_threads": torch.get_num_threads(),
        "trainable_params": sum(p.numel() for p in params),
        # AdamW makes a parameter's state at its first gradient: a per-expert LoRA module whose expert got no
        # token yet has none, so until every expert was routed to, a model of per-expert modules holds less
        # state than it will for the rest of a fine-tune (the share of trainable elements that have one)
        "optimizer_state_share": with_state / max(1, sum(p.numel() for p in params)),
        "step_s_all": seconds,
        "losses": losses,
        # the process's anonymous memory after each step: a set that still grows after the first step (the
        # allocator's heap, state made late) shows here, where the peak alone hides when it formed
        "anon_gib_after_step": [round(x, 3) for x in anon_gib],
    }


def step_profiler(device):
    """torch.profiler over one step: the operators' CPU time, and the kernels' device time on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def write_profile(profiler, device, path: Path) -> None:
    """The profiled step's operators, the most expensive first by self CPU time, and on CUDA first by self
    device time, with their call counts: where a variant's step goes, for ``--profile``. Written whole or not
    at all."""
    averages = profiler.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    if device.type == "cuda":  # the device's kernels first, then what the host spent launching them
        table = averages.table(sort_by="self_cuda_time_total", row_limit=PROFILE_ROWS) + "\n\nhost:\n" + table
    tmp = path.with_suffix(".tmp")
    tmp.write_text(table + "\n")
    tmp.replace(path)


def child_baseline(spec: dict) -> dict:
    """transformers + PEFT, as a user would write it."""
    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=getattr(torch, spec["dtype"]))
    if int(transformers.__version__.split(".")[0]) >= 5:  # fused experts: PEFT's ParamWrapper on them
        targets = dict(target_modules=ATTENTION_TARGETS, target_parameters=list(FUSED_EXPERT_TARGETS))
    else:  # transformers 4.x (--baseline-python): one nn.Linear per expert
        targets = dict(target_modules=spec["baseline_targets"])
    model = get_peft_model(
        model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none", **targets)
    )
    model.to(spec["device"])
    load_s = time.perf_counter() - t0
    memory_after_load = proc_status_kib()
    print(f"loaded in {load_s:.1f} s", flush=True)
    out = timed_steps(model, spec)
    out.update(
        load_s=load_s,
        memory_after_load_kib=memory_after_load,
        versions={"transformers": transformers.__version__, "peft": peft.__version__},
    )
    return out


class NotAvailable(Exception):
    """A variant whose config fields the lab does not take yet."""


def child_lab(spec: dict) -> dict:
    """The lab's fine-tuning path (checks, loading, the LoRA method) up to the optimizer; the benchmark's steps."""
    import torch

    from moe_core.finetune.config import FinetuneConfig, FinetuneError
    from moe_core.finetune.methods import expert_axes
    from moe_core.finetune.run import load_inputs, select_parameters
    from moe_core.train.optim import ExpertAdamW

    torch.manual_seed(spec["seed"])
    base = {
        "model": {"path": spec["checkpoint"], "dtype": spec["dtype"]},
        "method": "lora",
        "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "experts": "all"},
        "data": {"max_length": max(8, spec["seq"])},
        "batch_size": spec["batch"],
        "steps": spec["warmup"] + spec["steps"],
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "optim": {"lr": LR, "grad_clip": CLIP},
        "seed": spec["seed"],
    }
    try:
        config = FinetuneConfig.build(base).with_overrides(spec["lab_sets"])
    except FinetuneError as err:
        if spec["optional"]:  # a variant for a field that has not landed yet
            raise NotAvailable(str(err).splitlines()[0]) from None
        raise
    spec = {**spec, "gradient_checkpointing": config.gradient_checkpointing}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ft-scale-lab-") as scratch:
        inputs = load_inputs(config, records=spec["records"])
        selected = select_parameters(config, inputs, Path(scratch))
    model = selected.train_model.to(spec["device"])
    if spec.get("expert_impl"):  # --lab-expert-impl: auto's choice of expert path replaced
        from moe_core.experts import StackedExperts  # the child's imports are its own (see child_main)

        for module in model.modules():
            if isinstance(module, StackedExperts):
                module.impl = spec["expert_impl"]
    load_s = time.perf_counter() - t0
    memory_after_load = proc_status_kib()
    print(f"loaded in {load_s:.1f} s", flush=True)
    # the lab's AdamW as its trainer builds it (`objectives._MoEMetrics.create_optimizer`): with
    # optim.idle_experts=hold, each expert of a stacked factor steps as its own parameter
    axes = expert_axes(model) if config.optim.idle_experts == "hold" else {}
    out = timed_steps(model, spec, ExpertAdamW, expert_axes=axes) if axes else timed_steps(model, spec)
    out.update(load_s=load_s, memory_after_load_kib=memory_after_load, lab_config=config.model_dump())
    if spec["generate"]:
        out["generation"] = generate_after_training(model, spec)
    return out


def generate_after_training(model, spec: dict) -> dict:
    """``--generate N``: the trained model (the adapter over the base it trained on: 4-bit experts under
    QLoRA, unmerged, as `moe_core.load(OUT)` rebuilds it) decodes N greedy tokens after the first 16 of the
    benchmark's tokens, with a KV cache."""
    import torch

    from moe_core.finetune.methods import unwrap

    trained = unwrap(model).eval()
    prompt_BS = torch.tensor(spec["tokens"][0][:1], dtype=torch.long, device=spec["device"])[:, :16]
    t0 = time.perf_counter()
    with torch.no_grad():
        out_BS = trained.generate(
            input_ids=prompt_BS,
            max_new_tokens=spec["generate"],
            min_new_tokens=spec["generate"],
            do_sample=False,
        )
    seconds = time.perf_counter() - t0
    new = out_BS[0, prompt_BS.shape[1] :].tolist()
    print(f"generated {len(new)} tokens in {seconds:.1f} s", flush=True)
    return {
        "new_tokens": len(new),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(len(new) / seconds, 3),
    }


def child_main(kind: str, spec_path: Path, result_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    if spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])
    try:
        out = child_baseline(spec) if kind == "baseline" else child_lab(spec)
        out["status"] = "ok"
    except NotAvailable as err:
        out = {"status": "not available yet", "reason": str(err)}
    if spec["device"].startswith("cuda"):
        import torch

        out["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    out["memory_at_end_kib"] = proc_status_kib()
    result_path.write_text(json.dumps(out))
    return 0


# ================================================================================================ the parent
def run_child(
    kind: str, name: str, spec: dict, workdir: Path, python: str, max_rss_gib: float | None
) -> dict:
    """Run one variant in a child process and watch its memory; its result with the memory figures added."""
    spec_path, result_path, log_path = (workdir / f"{name}.{x}" for x in ("spec.json", "result.json", "log"))
    if spec.get("profile_dir"):
        spec = {**spec, "profile_path": str(Path(spec["profile_dir"]) / f"{name}.profile.txt")}
    spec_path.write_text(json.dumps(spec))
    import moe_core  # the children import the same lab as this process

    lab_root = str(Path(moe_core.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [lab_root, os.environ.get("PYTHONPATH")])),
    }
    if spec["threads"]:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    command = [python, str(Path(__file__).resolve()), "--child", kind, "--spec", str(spec_path)]
    command += ["--result", str(result_path)]
    row = watch_child(command, env, log_path, max_rss_gib)
    row["peak_rss_gib"] = row["ru_maxrss_gib"]  # the kernel's peak, as every row in benchmarks/README.md
    if row["exit_code"] == 0:
        if result_path.is_file():
            row.update(json.loads(result_path.read_text()))
        else:
            row["status"] = "failed (exit 0 without a result)"
    if row.get("status") == "ok":
        timed = row["step_s_all"][spec["warmup"] :]
        row["step_s"] = statistics.median(timed)
        row["tokens_per_s"] = spec["batch"] * spec["seq"] / row["step_s"]
    return row


def benchmark_tokens(
    checkpoint: Path, batch: int, seq: int, steps: int = 1
) -> tuple[list[list[list[int]]], list[dict]]:
    """``steps`` batches of ``batch`` rows of ``seq`` token ids, each step the next tokens of the examples of
    ``examples/sft.jsonl`` framed by the checkpoint's chat template, back to back (repeated as needed), as a
    fine-tune reads new data at every step (a step repeating the same tokens routes to the same experts, and
    per-expert LoRA modules that never get a token never get an optimizer state: a fixed batch flatters them);
    and those examples as records, for the lab's checks."""
    from moe_core.data.sources import to_messages
    from moe_core.data.tokenizer import load_tokenizer

    records = [json.loads(line) for line in SFT_DATA.read_text().splitlines() if line.strip()]
    tokenizer = load_tokenizer(checkpoint)
    stream: list[int] = []
    for record in records:
        # return_dict=False: the ids (transformers 5 returns a BatchEncoding by default)
        stream += list(tokenizer.apply_chat_template(to_messages(record), tokenize=True, return_dict=False))
    needed = steps * batch * seq
    stream = (stream * (needed // len(stream) + 1))[:needed]
    rows = [stream[i * seq : (i + 1) * seq] for i in range(steps * batch)]
    return [rows[k * batch : (k + 1) * batch] for k in range(steps)], records


# the baseline's LoRA targets under transformers 5, which holds each layer's experts as two fused parameters
ATTENTION_TARGETS = r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"
FUSED_EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def baseline_targets(model_type: str) -> str:
    """PEFT ``target_modules`` (a regex over module names) for q/k/v/o and every expert's three projections, in
    transformers 4.57's per-expert module names (`moe_core.convert.ARCHITECTURES` knows them): the baseline in an
    environment pinned to transformers 4.57 (``--baseline-python``); under transformers 5 it adapts the fused
    experts instead (`ATTENTION_TARGETS`, `FUSED_EXPERT_TARGETS`)."""
    from moe_core.convert import ARCHITECTURES

    arch = ARCHITECTURES[model_type]
    projs = "|".join(arch.expert_weights)
    return rf"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|{arch.moe_module}\.experts\.\d+\.({projs}))"


# --baseline-env: the baseline's own environment, pinned, beside this one's torch (a venv that sees the system's
# site-packages, so torch is the same build; its own transformers/peft shadow ours). transformers 4.57 keeps one
# nn.Linear per expert, as hub checkpoints store them: memory-mapped and adapted by PEFT's plain LoRA, the layout
# issue 31 names as the baseline (transformers 5 fuses the experts at load, copying them, and PEFT's
# target_parameters then forms every expert's delta weight at every forward).
BASELINE_ENVS = {
    "transformers4": [
        "transformers==4.57.6",
        "peft==0.17.1",
        "huggingface_hub>=0.34,<1.0",
        "tokenizers>=0.22,<0.23",
    ],
}


def baseline_env(name: str, cache_dir: str | None) -> str:
    """The interpreter of environment ``name`` (`BASELINE_ENVS`), built on first use under the published
    cache's sibling ``envs/`` (`envs.cached_env`; the torch this script runs under is kept: a constraint pins
    it, and the environment sees this one's site-packages)."""
    from moe_core.published import cache_root

    pins = "-".join(r.split("==")[1] for r in BASELINE_ENVS[name] if "==" in r)
    home = cache_root(cache_dir).parent / "envs" / f"{name}-{pins}"
    requirements = [*BASELINE_ENVS[name], f"torch=={metadata.version('torch')}"]
    return cached_env(home, requirements, system_site_packages=True)


def warm_page_cache(directory: Path) -> bool:
    """Read the weight files once so the first child does not pay the disk for the others (file pages only: this
    process's memory does not grow); skipped when they would not fit in half the available memory."""
    files = sorted(directory.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    available = child_memory.meminfo_kib().get("MemAvailable", 0) * 1024
    if size > available / 2:
        return False
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.read(16 * 2**20):
                pass
    return True


def evict_page_cache(directory: Path) -> None:
    """Drop the weight files' pages from the page cache (``posix_fadvise(DONTNEED)``: no privileges needed; pages
    another process maps stay), so that the next child reads them from the disk as the first child did."""
    for file in sorted(directory.glob("*.safetensors")):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def machine(device: str) -> dict:
    """What the figures were taken on (the baseline child reports the versions it ran with, too)."""
    info = {**child_memory.machine(("torch", "transformers", "peft")), "device": device}
    if device.startswith("cuda"):
        import torch  # the parent imports torch only to name the GPU

        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible"
    return info


def variants(args) -> list[tuple[str, str, list[str], bool]]:
    """(name, child kind, lab --set fields, optional)."""
    out = [("baseline", "baseline", [], False), ("lab", "lab", list(args.lab_set), False)]
    for scheme in args.qlora:
        base, _, part = scheme.partition("-")
        fields = [f"{QLORA_FIELD}={base}"]
        if part:  # the attention in 4 bits (-attn, the default) or in the model's dtype (-experts)
            fields.append(f"quantize.attention={'true' if part == 'attn' else 'false'}")
        out.append((f"lab-qlora-{scheme}", "lab", [*args.lab_set, *fields], True))
    if args.copy:
        out.append(("lab-copy", "lab", [*args.lab_set, f"{MMAP_FIELD}=false"], True))
    return out


def _gib(x) -> str:
    return f"{x:.2f}" if isinstance(x, int | float) else "-"


def print_table(figures: dict, raw: dict) -> None:
    m = figures
    threads = sorted({row["torch_threads"] for row in m["results"].values() if "torch_threads" in row})
    threads = "/".join(map(str, threads)) or "?"
    print(
        f"\n{m['model']} ({m['hub_id']}), {m['layers']} of {m['published_layers']} layers"
        f"{' (tiny: shrunken config)' if m['tiny'] else ''}"
        f"{' (narrow: tiny widths, published counts)' if m.get('narrow') else ''}: "
        f"{m['parameters'] / 1e9:.3f} B parameters, "
        f"{m['checkpoint_gib']:.2f} GiB bf16 on disk, run in {m['dtype']}; batch {m['batch']} x {m['seq']} tokens, median of {m['steps']} "
        f"steps after {m['warmup']} warm-up, {threads} torch thread(s) per child on {m['device']}"
    )
    header = (
        f"{'variant':<21}{'status':<10}{'step s':>8}{'x base':>8}{'tok/s':>8}{'load s':>8}"
        f"{'peak GiB':>10}{'anon':>7}{'file':>7}{'x base':>8}{'max anon':>10}{'x base':>8}{'trainable M':>13}"
        f"{'w/ state':>9}{'loss 0 -> n':>20}"
    )
    print(header)
    base = m["results"].get("baseline", {})
    for name, row in m["results"].items():
        ok = row.get("status") == "ok"
        ratio_t = row["step_s"] / base["step_s"] if ok and base.get("status") == "ok" else None
        ratio_m = row["peak_rss_gib"] / base["peak_rss_gib"] if base.get("peak_rss_gib") else None
        ratio_a = row["peak_anon_gib"] / base["peak_anon_gib"] if base.get("peak_anon_gib") else None
        losses = row.get("losses") or []
        print(
            f"{name:<21}{('ok' if ok else 'see below'):<10}{_gib(row.get('step_s')):>8}{_gib(ratio_t):>8}"
            f"{row.get('tokens_per_s', 0):>8.0f}{_gib(row.get('load_s')):>8}{_gib(row.get('peak_rss_gib')):>10}"
            f"{_gib(row.get('rss_anon_gib_at_peak')):>7}{_gib(row.get('rss_file_gib_at_peak')):>7}"
            f"{_gib(ratio_m):>8}{_gib(row.get('peak_anon_gib')):>10}{_gib(ratio_a):>8}"
            f"{row.get('trainable_params', 0) / 1e6:>13.2f}"
            f"{_gib(row.get('optimizer_state_share')):>9}"
            f"{(f'{losses[0]:.3f} -> {losses[-1]:.3f}' if losses else '-'):>20}"
        )
    for name, row in m["results"].items():
        if row.get("status") != "ok":
            print(f"  {name}: {row.get('status')}{': ' + row['reason'] if row.get('reason') else ''}")
            if raw[name].get("log_tail"):  # not in the JSON line
                print("    " + raw[name]["log_tail"].strip().replace("\n", "\n    ")[-1500:])


def ratio(row: dict, reference: dict) -> dict:
    """``row`` over ``reference``: step time (both ran), peak RSS (``row`` ran; a baseline killed for memory still
    has its peak) and, on a GPU, the device's peak allocation."""
    out: dict = {}
    if row.get("status") != "ok":
        return out
    if reference.get("status") == "ok":
        out["step_time"] = round(row["step_s"] / reference["step_s"], 3)
    if reference.get("peak_rss_gib"):
        out["peak_rss"] = round(row["peak_rss_gib"] / reference["peak_rss_gib"], 3)
    if reference.get("peak_anon_gib"):
        out["peak_anon"] = round(row["peak_anon_gib"] / reference["peak_anon_gib"], 3)
    if row.get("cuda_peak_gib") and reference.get("cuda_peak_gib"):
        out["cuda_peak"] = round(row["cuda_peak_gib"] / reference["cuda_peak_gib"], 3)
    return out


def _round(row: dict) -> dict:
    keep = {}
    for key, value in row.items():
        if key in ("memory_after_load_kib", "memory_at_end_kib", "lab_config", "log_tail"):
            continue
        if isinstance(value, float):
            value = round(value, 4)
        elif isinstance(value, list):
            value = [round(v, 4) if isinstance(v, float) else v for v in value]
        keep[key] = value
    after_load = row.get("memory_after_load_kib") or {}
    if after_load:
        keep["rss_after_load_gib"] = round(after_load.get("VmRSS", 0) / 2**20, 3)
    return keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="olmoe-1b-7b", help="a published model (moe_core.published.PUBLISHED)"
    )
    parser.add_argument("--layers", type=int, default=None, help="cut to the first N decoder layers")
    parser.add_argument("--tiny", action="store_true", help="a shrunken config of the same architecture")
    parser.add_argument(
        "--narrow",
        action="store_true",
        help="the published counts (layers, experts, top-k) at --tiny's widths: a step bound by dispatching its "
        "operators, as a GPU step's host is",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads per child (default: torch's)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the frozen base, both sides"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="in every variant")
    parser.add_argument(
        "--qlora",
        action="append",
        default=[],
        choices=[f"{b}{p}" for b in ("int4", "nf4") for p in ("", "-attn", "-experts")],
        help="add a QLoRA variant (the lab's default: attention in 4 bits too; -attn says so, -experts keeps the "
        "attention in the model's dtype: quantize.attention=false)",
    )
    parser.add_argument(
        "--copy", action="store_true", help="add the lab with its base copied into memory (model.mmap=false)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the checkpoint from the page cache before each child (each starts from the disk; without it "
        "a later child finds an earlier one's pages cached, and at sizes beyond memory how many stay mapped, "
        "file-backed RSS, then differs by a GiB either way)",
    )
    parser.add_argument(
        "--lab-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a FinetuneConfig field for the lab",
    )
    parser.add_argument(
        "--lab-expert-impl",
        default=None,
        metavar="IMPL",
        help="the lab variants' expert path instead of auto's choice (sorted, grouped_mm, ...)",
    )
    parser.add_argument("--only", action="append", default=[], help="run only these variants (repeatable)")
    parser.add_argument(
        "--generate",
        type=int,
        default=0,
        help="after its steps, each lab variant greedily decodes this many tokens with its adapter",
    )
    parser.add_argument(
        "--baseline-env",
        choices=sorted(BASELINE_ENVS),
        help="run the baseline in an environment this script builds and caches (pinned versions, see top)",
    )
    parser.add_argument(
        "--baseline-python", default=sys.executable, help="interpreter for the baseline child"
    )
    parser.add_argument(
        "--max-rss-gib", type=float, default=None, help="stop a child whose RSS grows past this"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="one more step per variant, untimed, under torch.profiler: DIR/VARIANT.profile.txt, its "
        "operators by self time (device time on CUDA)",
    )
    parser.add_argument("--cache-dir", default=None, help="default: $MOE_LAB_PUBLISHED_CACHE or ~/.cache/...")
    parser.add_argument(
        "--build-only", action="store_true", help="write the stand-in checkpoint, print its path"
    )
    parser.add_argument("--child", choices=["baseline", "lab"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.spec, args.result)

    from moe_core.config import EXPERT_IMPLS
    from moe_core.published import PUBLISHED, PublishedError, build_published

    if args.lab_expert_impl is not None and args.lab_expert_impl not in EXPERT_IMPLS:
        parser.error(f"--lab-expert-impl {args.lab_expert_impl!r}: choose one of {', '.join(EXPERT_IMPLS)}")
    if args.model not in PUBLISHED:
        parser.error(f"--model {args.model!r}: choose one of {', '.join(PUBLISHED)}")
    for flag in ("batch", "seq", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    known = [name for name, *_ in variants(args)]
    unknown = [name for name in args.only if name not in known]
    if unknown:
        parser.error(f"--only {unknown}: not among this run's variants {known}")
    published = PUBLISHED[args.model]
    if args.tiny and args.narrow:
        parser.error("--tiny and --narrow: choose one")
    layers = args.layers if args.layers is not None else (2 if args.tiny else None)
    overrides = published.tiny_overrides if args.tiny else None
    if args.narrow:  # the widths shrunk, every count kept
        overrides = {k: v for k, v in published.tiny_overrides.items() if k not in COUNT_FIELDS}
    try:
        checkpoint = build_published(
            args.model,
            layers=layers,
            overrides=overrides,
            cache_dir=args.cache_dir,
            seed=args.seed,
            tokenizer_vocab=TINY_TOKENIZER_VOCAB if args.tiny or args.narrow else 4096,
            progress=lambda line: print(line, flush=True),
        )
    except PublishedError as err:
        parser.error(str(err))
    record = json.loads((checkpoint / "published.json").read_text())
    if args.build_only:
        print(checkpoint)
        return 0
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.baseline_env and (not args.only or "baseline" in args.only):
        args.baseline_python = baseline_env(args.baseline_env, args.cache_dir)
    config = json.loads((checkpoint / "config.json").read_text())
    tokens, records = benchmark_tokens(checkpoint, args.batch, args.seq, args.warmup + args.steps)
    warmed = False if args.cold else warm_page_cache(checkpoint)
    spec_common = {
        "checkpoint": str(checkpoint),
        "tokens": tokens,
        "records": records,
        "batch": args.batch,
        "seq": args.seq,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "gradient_checkpointing": args.gradient_checkpointing,
        "baseline_targets": baseline_targets(config["model_type"]),
        "generate": args.generate,
        "profile_dir": str(args.profile.resolve()) if args.profile else None,
        "expert_impl": args.lab_expert_impl,
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ft-scale-") as tmp:
        for name, kind, lab_sets, optional in variants(args):
            if args.only and name not in args.only:
                continue
            print(f"running {name} (its log: {Path(tmp) / name}.log) ...", flush=True)
            spec = {**spec_common, "lab_sets": lab_sets, "optional": optional}
            python = args.baseline_python if kind == "baseline" else sys.executable
            if args.cold:
                evict_page_cache(checkpoint)
            results[name] = run_child(kind, name, spec, Path(tmp), python, args.max_rss_gib)
            # each variant's figures as it ends: a caller that stops this run at a time limit keeps them
            print(f"{RESULT_PREFIX}{json.dumps({name: _round(results[name])})}", flush=True)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = {
        "benchmark": "finetune_scale",
        "model": args.model,
        "hub_id": published.hub_id,
        "tiny": args.tiny,
        "narrow": args.narrow,
        "layers": config["num_hidden_layers"],
        "published_layers": published.config["num_hidden_layers"],
        "parameters": record["parameters"],
        "checkpoint_gib": round(record["bytes"] / GIB, 3),
        "checkpoint": str(checkpoint),
        "batch": args.batch,
        "seq": args.seq,
        "warmup": args.warmup,
        "steps": args.steps,
        "device": args.device,
        "dtype": args.dtype,
        "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": "q,k,v,o + every expert's gate/up/down"},
        "page_cache_warmed": warmed,
        "page_cache_cold_per_child": args.cold,
        "machine": machine(args.device),
        "results": {name: _round(row) for name, row in results.items()},
        "lab_over_baseline": ratio(results.get("lab", {}), results.get("baseline", {})),
        # the optional variants (QLoRA, copy) against the lab's bf16 LoRA: the issue states QLoRA's slowdown
        "variants_over_lab": {
            name: ratio(row, results.get("lab", {}))
            for name, row in results.items()
            if name not in ("baseline", "lab")
        },
        "children_max_rss_gib": round(children.ru_maxrss / 2**20, 3),
    }
    print_table(figures, results)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
