"""Published MoE configs at full width, loaded through `moe_core.load`: peak memory against the checkpoint's bytes
(issue 32 §4).

For each published family (`moe_core.published.PUBLISHED`, ``--only NAME`` repeatable), the stand-in is the
published ``config.json`` at full width (hidden size, heads, expert widths and vocabulary as published) cut to
its first ``--layers`` decoder layers, with random bf16 weights in the hub's sharded layout
(`moe_core.published.build_published`; nothing is downloaded). Every expert is kept unless ``--max-experts N``
caps the routed experts (the table and the JSON line say when the cap was used). For the families whose first
layer(s) are dense (DeepSeek-V2/V3, Moonlight, GLM-4.5: ``first_k_dense_replace``), ``--layers`` is raised to
include at least one MoE layer.

Then, one after the other (never two at once), each in a fresh child process:

- ``imports``: the same imports as the loading children (torch, transformers, the lab) and no model: the
  import overhead every figure below includes;
- ``copy``: ``moe_core.load(dir, dtype=torch.bfloat16)``, the weights copied into memory;
- ``mmap``: ``moe_core.load(dir, dtype=torch.bfloat16, memory_map=True)``, the weights memory-mapped from the
  safetensors shards (`moe_core.mapped`);

and each loading child runs one forward of 8 tokens. Memory per child: the peak resident set from the kernel
(the child's own ``VmHWM`` at its end; ``wait4``'s ``ru_maxrss``, as `benchmarks/finetune_scale.py` takes it,
is reported beside it but also counts the resident set the parent had when it forked, ~0.4 GiB of torch), and from ``/proc/<pid>/status`` polled
every 50 ms the anonymous and file-backed parts (``RssAnon`` / ``RssFile``) at the largest resident set seen and
the largest anonymous part seen. ``peak / bytes``: the peak resident set over the checkpoint's bytes;
``(peak - imports) / bytes``: the same with the import child's peak taken off, which is what loading itself
costs. The issue's target: the copied load close to the checkpoint's bytes, the mapped one's anonymous memory far
below them. Load seconds are reported, but timings on a shared machine are not trustworthy.

Each stand-in is built in ``--cache-dir`` (default: the published cache, see `moe_core.published.cache_root`) and,
with ``--delete``, removed as soon as it is measured (a full-width stand-in is GiBs of disk).

Prints a table, then ONE JSON line: per family the checkpoint's bytes and each child's figures, and the machine.

    python benchmarks/load_published.py --cache-dir /scratch/lp --delete                 # every family, 2 layers
    python benchmarks/load_published.py --only glm-4.5-air --max-experts 64              # GLM-4.5-Air, 64 of 128
    python benchmarks/load_published.py --only mixtral-8x7b --layers 1                   # 3.2 GiB
    python benchmarks/load_published.py --tiny --only olmoe-1b-7b                        # shrunken, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when loaded from its path
import child_memory  # noqa: E402
from child_memory import GIB, proc_status_kib, watch_child  # noqa: E402

# Only the standard library at the top: this file is also the children's program, and the import child must
# measure exactly what the loading children import. torch and the lab are imported inside the functions.

FORWARD_TOKENS = 8
TINY_TOKENIZER_VOCAB = 400
CHILDREN = ("imports", "copy", "mmap")
RESULT_PREFIX = "family result: "  # one stdout line per measured family
# the config field that holds the routed-expert count, per family's config.json
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


# ================================================================================================ the children
def child_main(kind: str, checkpoint: str, result_path: Path) -> int:
    """One child: the imports every child makes, then (``copy`` / ``mmap``) the load and one forward."""
    import torch

    import moe_core

    out: dict = {"status": "ok", "memory_after_imports_kib": proc_status_kib()}
    if kind != "imports":
        t0 = time.perf_counter()
        loaded = moe_core.load(checkpoint, dtype=torch.bfloat16, memory_map=kind == "mmap")
        out["load_s"] = time.perf_counter() - t0
        out["memory_after_load_kib"] = proc_status_kib()
        model = loaded.model
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        vocab = model.config.vocab_size
        ids_BS = (torch.arange(FORWARD_TOKENS) * 7919 % vocab).unsqueeze(0)  # B = 1 row, S = 8 tokens
        t0 = time.perf_counter()
        with torch.no_grad():
            logits_BSV = model(input_ids=ids_BS).logits
        out["forward_s"] = time.perf_counter() - t0
        out["logits_finite"] = bool(torch.isfinite(logits_BSV.float()).all())
        out["logits_shape"] = list(logits_BSV.shape)
    out["memory_at_end_kib"] = proc_status_kib()
    result_path.write_text(json.dumps(out))
    return 0


# ================================================================================================ the parent
def run_child(kind: str, checkpoint: Path, workdir: Path, max_rss_gib: float | None) -> dict:
    """Run one child and watch its memory; its result with the memory figures added."""
    result_path, log_path = workdir / f"{kind}.result.json", workdir / f"{kind}.log"
    result_path.unlink(missing_ok=True)
    import moe_core  # the children import the same lab as this process

    lab_root = str(Path(moe_core.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [lab_root, os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind]
    command += ["--checkpoint", str(checkpoint), "--result", str(result_path)]
    row = watch_child(command, env, log_path, max_rss_gib)
    # ru_maxrss also counts what this process (torch and the lab, ~0.4 GiB) had resident when it forked the
    # child, which would hide a small child's own peak: the child's own high-water mark (VmHWM) is the figure,
    # polled and read once more at its end
    row["peak_rss_gib"] = max(row["vm_hwm_gib"], row["rss_anon_gib_at_peak"] + row["rss_file_gib_at_peak"])
    if row["exit_code"] == 0:
        if result_path.is_file():
            row.update(json.loads(result_path.read_text()))
            hwm_kib = row["memory_at_end_kib"].get("VmHWM", 0)
            row["peak_rss_gib"] = max(row["peak_rss_gib"], hwm_kib * 1024 / GIB)
        else:
            row["status"] = "failed (exit 0 without a result)"
    return row


def standin_request(name: str, layers: int, max_experts: int | None, tiny: bool) -> tuple[int, dict, dict]:
    """(layers, overrides, notes) for one family's stand-in: ``layers`` raised past the dense leading layers,
    the routed experts capped at ``max_experts`` (and top-k with them)."""
    from moe_core.published import PUBLISHED

    published = PUBLISHED[name].config
    overrides = dict(PUBLISHED[name].tiny_overrides) if tiny else {}
    notes: dict = {}
    dense = published.get("first_k_dense_replace") or 0
    if layers <= dense:
        notes["layers_raised_from"] = layers
        layers = dense + 1
    layers = min(layers, published["num_hidden_layers"])
    field = next(f for f in EXPERT_FIELDS if f in published)
    experts = overrides.get(field, published[field])
    if max_experts is not None and max_experts < experts:
        overrides[field] = max_experts
        top_k = overrides.get("num_experts_per_tok", published["num_experts_per_tok"])
        if top_k > max_experts:
            overrides["num_experts_per_tok"] = max_experts
        notes["experts_capped"] = {"published": published[field], "kept": max_experts}
    return layers, overrides, notes


def checkpoint_bytes_planned(name: str, layers: int, overrides: dict) -> int:
    """The stand-in's bytes, from its tensor layout (nothing allocated): checked before anything is written."""
    import torch

    from moe_core.published import published_config, tensor_layout

    layout = tensor_layout(published_config(name, layers, overrides))
    return sum(int(torch.Size(shape).numel()) for _, shape in layout) * 2


def machine() -> dict:
    return child_memory.machine(("torch", "transformers", "safetensors"))


def summarize(rows: dict[str, dict], checkpoint_bytes: int) -> dict:
    """Each child's figures rounded, and the ratios to the checkpoint's bytes."""
    out: dict = {}
    imports_peak = rows.get("imports", {}).get("peak_rss_gib")
    ckpt_gib = checkpoint_bytes / GIB
    for kind, row in rows.items():
        keep = {}
        for key, value in row.items():
            if key in ("memory_after_imports_kib", "memory_at_end_kib", "log_tail"):
                continue
            if key == "memory_after_load_kib":
                keep["rss_after_load_gib"] = round(value.get("VmRSS", 0) / 2**20, 3)
                keep["anon_after_load_gib"] = round(value.get("RssAnon", 0) / 2**20, 3)
                continue
            keep[key] = round(value, 4) if isinstance(value, float) else value
        if kind != "imports" and row.get("peak_rss_gib"):
            keep["peak_over_bytes"] = round(row["peak_rss_gib"] / ckpt_gib, 3)
            keep["peak_anon_over_bytes"] = round(row["peak_anon_gib"] / ckpt_gib, 3)
            if imports_peak is not None:
                keep["peak_less_imports_over_bytes"] = round(
                    (row["peak_rss_gib"] - imports_peak) / ckpt_gib, 3
                )
                keep["peak_anon_less_imports_over_bytes"] = round(
                    (row["peak_anon_gib"] - rows["imports"]["peak_anon_gib"]) / ckpt_gib, 3
                )
        out[kind] = keep
    return out


def _f(x, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, int | float) else "-"


def print_table(figures: dict) -> None:
    print(
        f"\n{'family':<19}{'layers':>7}{'experts':>9}{'ckpt GiB':>10}  {'child':<8}{'status':<8}{'peak GiB':>9}"
        f"{'anon':>7}{'file':>7}{'max anon':>9}{'peak/B':>8}{'-imp/B':>8}{'anon-imp/B':>11}{'load s':>8}"
    )
    for name, fam in figures["families"].items():
        experts = f"{fam['experts']}" + ("*" if fam.get("experts_capped") else "")
        for kind, row in fam["children"].items():
            print(
                f"{name:<19}{fam['layers']:>7}{experts:>9}{_f(fam['checkpoint_gib']):>10}  {kind:<8}"
                f"{('ok' if row.get('status') == 'ok' else 'FAILED'):<8}{_f(row.get('peak_rss_gib')):>9}"
                f"{_f(row.get('rss_anon_gib_at_peak')):>7}{_f(row.get('rss_file_gib_at_peak')):>7}"
                f"{_f(row.get('peak_anon_gib')):>9}{_f(row.get('peak_over_bytes')):>8}"
                f"{_f(row.get('peak_less_imports_over_bytes')):>8}"
                f"{_f(row.get('peak_anon_less_imports_over_bytes')):>11}{_f(row.get('load_s'), 1):>8}"
            )
            if row.get("status") != "ok":
                print(f"    {row.get('status')}")
    if any(fam.get("experts_capped") for fam in figures["families"].values()):
        print("* routed experts capped by --max-experts (the published count is in the JSON line)")
    print(
        "peak/B: peak resident set over the checkpoint's bytes; -imp/B: less the import child's peak; "
        "anon-imp/B: largest anonymous set less the import child's, over the bytes. "
        "Load seconds: not trustworthy on a shared machine."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", action="append", default=[], help="a published model (repeatable; default: all)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=2,
        help="decoder layers kept (raised past a family's dense leading layers)",
    )
    parser.add_argument("--max-experts", type=int, default=None, help="cap the routed experts per MoE layer")
    parser.add_argument("--tiny", action="store_true", help="a shrunken config of each family (for its test)")
    parser.add_argument("--cache-dir", default=None, help="default: $MOE_LAB_PUBLISHED_CACHE or ~/.cache/...")
    parser.add_argument("--delete", action="store_true", help="remove each stand-in once it is measured")
    parser.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="refuse a stand-in larger than this on disk (checked from its config before it is built)",
    )
    parser.add_argument(
        "--max-rss-gib", type=float, default=None, help="stop a child whose RSS grows past this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.checkpoint, args.result)

    from moe_core.published import PUBLISHED, build_published, published_model

    unknown = [name for name in args.only if name not in PUBLISHED]
    if unknown:
        parser.error(f"--only {unknown}: choose among {', '.join(PUBLISHED)}")
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    if args.max_experts is not None and args.max_experts < 1:
        parser.error("--max-experts must be at least 1")
    names = args.only or list(PUBLISHED)
    # every request checked (and sized) before anything is built
    plans = {}
    for name in names:
        layers, overrides, notes = standin_request(name, args.layers, args.max_experts, args.tiny)
        planned = checkpoint_bytes_planned(name, layers, overrides)
        if args.max_gib is not None and planned > args.max_gib * GIB:
            parser.error(
                f"{name}: {layers} layers are {planned / GIB:.2f} GiB on disk, over --max-gib {args.max_gib}: "
                "pass a smaller --layers or a --max-experts cap (or --only the other families)"
            )
        plans[name] = (layers, overrides, notes, planned)

    families: dict[str, dict] = {}
    for name, (layers, overrides, notes, planned) in plans.items():
        print(f"{name}: building the stand-in ({layers} layers, {planned / GIB:.2f} GiB) ...", flush=True)
        checkpoint = build_published(
            name,
            layers=layers,
            overrides=overrides or None,
            cache_dir=args.cache_dir,
            seed=args.seed,
            tokenizer_vocab=TINY_TOKENIZER_VOCAB if args.tiny else 4096,
            progress=lambda line: print(line, flush=True),
        )
        record = json.loads((checkpoint / "published.json").read_text())
        config = json.loads((checkpoint / "config.json").read_text())
        field = next(f for f in EXPERT_FIELDS if f in config)
        rows: dict[str, dict] = {}
        try:
            with tempfile.TemporaryDirectory(prefix="load-published-") as tmp:
                for kind in CHILDREN:
                    print(f"{name}: {kind} child ...", flush=True)
                    rows[kind] = run_child(kind, checkpoint, Path(tmp), args.max_rss_gib)
        finally:
            if args.delete:
                shutil.rmtree(checkpoint, ignore_errors=True)
        families[name] = {
            "hub_id": published_model(name).hub_id,
            "model_type": config["model_type"],
            "layers": config["num_hidden_layers"],
            "published_layers": PUBLISHED[name].config["num_hidden_layers"],
            "experts": config[field],
            **notes,
            "parameters": record["parameters"],
            "checkpoint_bytes": record["bytes"],
            "checkpoint_gib": round(record["bytes"] / GIB, 3),
            "checkpoint": str(checkpoint),
            "deleted": args.delete,
            "children": summarize(rows, record["bytes"]),
        }
        # each family's figures as it ends: a run stopped later keeps them
        print(f"{RESULT_PREFIX}{json.dumps({name: families[name]})}", flush=True)
        for kind, row in rows.items():
            if row.get("log_tail"):  # not in the JSON line
                print(
                    f"{name} {kind}: {row['status']}\n    " + row["log_tail"].strip().replace("\n", "\n    ")
                )
    figures = {
        "benchmark": "load_published",
        "tiny": args.tiny,
        "layers_requested": args.layers,
        "max_experts": args.max_experts,
        "forward_tokens": FORWARD_TOKENS,
        "dtype": "bfloat16",
        "machine": machine(),
        "families": families,
    }
    print_table(figures)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
