"""One rank of tests/test_arch_parallel.py's multi-process runs, under ``python -m torch.distributed.run``: every
family preset of `PRESETS` trained in one launch (a launch costs more than the tiny runs it holds), one trainer
after another (each opens and closes its process group: `moe_core.train.parallel._attempt_store`).

--out ROOT          each run of `RUNS` in ROOT/<preset>/<layout> (`LAYOUTS`: ep2 with DDP, ep2 with FSDP2)
--finetune BASE OUT LoRA on the experts of the model in BASE/model (`FINETUNE_SETS`, its data BASE/data.jsonl) at
                    ep 2, into OUT: `moe-lab finetune --nproc 2`'s run, in this launch rather than another one

After each run, every rank compares what should be replicated with rank 0's copy (every parameter and
persistent buffer that is not an expert shard: attention, norms, dense leading layers, shared experts, routers
and their aux-loss-free biases) and rank 0 writes the largest difference per tensor into
ROOT/<preset>/<layout>/replicas.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from moe_core.finetune import FinetuneConfig, finetune
from moe_core.train import parallel as par
from moe_core.train.config import TrainConfig
from moe_core.train.loop import Trainer

PRESETS = ("qwen3-tiny", "deepseek-tiny", "gptoss-tiny", "glm4moe-tiny")
SETS = [
    "steps=4",
    "batch_size=8",
    "log.every=1",
    "log.progress=off",
    "data.source=synthetic",
    "data.seq_len=32",
    "data.synthetic_blocks=64",
    "checkpoint.every=2",
    "checkpoint.keep_last=3",
    "checkpoint.export=false",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "eval.batches=1",
]
# tests/test_finetune_parallel.py's settings: 4 steps of LoRA (r 4) on every expert and attention projection
FINETUNE_SETS = [
    "steps=4",
    "batch_size=2",
    "log.progress=off",
    "optim.lr=1e-2",
    "lora.r=4",
    "data.max_length=64",
    "checkpoint.every=2",
]
LAYOUTS = {
    "ep2": ["parallel.ep_size=2"],
    "fsdp2": ["parallel.ep_size=2", "parallel.dp_mode=fsdp2"],
}
# every family at ep 2; FSDP2 (dense weights sharded) on the two whose dense modules are new kinds of tensors
# (MLA's projections and norms; sinks and biased attention, router and experts), to keep the launch short
RUNS = [(preset, "ep2") for preset in PRESETS] + [("deepseek-tiny", "fsdp2"), ("gptoss-tiny", "fsdp2")]


# qwen3-tiny's 128 experts at 32: expert parallelism does the same per expert, and the per-expert loop of 128
# experts of width 24 made it the slowest run of the launch (the family's own pieces, per-head q/k norm and
# top-8 renormalized routing, are kept)
PRESET_SETS = {"qwen3-tiny": ["model.overrides.num_experts=32"]}


def config_for(preset: str, layout: list[str]) -> TrainConfig:
    return TrainConfig.from_preset(preset).with_overrides(SETS + PRESET_SETS.get(preset, []) + layout)


@torch.no_grad()
def replica_differences(trainer: Trainer) -> dict[str, float]:
    """Per replicated tensor (FSDP2 shards gathered), the largest absolute difference from rank 0's copy."""
    out = {}
    tensors = [*trainer.model.named_parameters(), *trainer.model.named_buffers()]
    for name, tensor in tensors:
        if par.is_expert_param(name):
            continue
        whole = tensor.full_tensor() if par.is_sharded(tensor) else tensor.detach().clone()
        reference = whole.clone()
        dist.broadcast(reference, src=0)
        out[name] = (whole.float() - reference.float()).abs().max().item()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--finetune", nargs=2, metavar=("BASE", "OUT"))
    args = p.parse_args()
    for preset, layout in RUNS:
        out = Path(args.out) / preset / layout
        trainer = Trainer(config_for(preset, LAYOUTS[layout]), out)
        try:
            trainer.save_checkpoint()  # step 0: the initial weights of this layout
            trainer.run()
            differences = replica_differences(trainer)
        finally:
            trainer.close()
        if trainer.state.is_main:
            (out / "replicas.json").write_text(json.dumps(differences, indent=1))

    if args.finetune:
        base, out = map(Path, args.finetune)
        finetune(finetune_config(base, ["parallel.ep_size=2"]), out)


def finetune_config(base: Path, extra: list[str]) -> FinetuneConfig:
    sets = [f"model.path={base / 'model'}", f"data.source={base / 'data.jsonl'}", *FINETUNE_SETS, *extra]
    return FinetuneConfig().with_overrides(sets)


if __name__ == "__main__":
    main()
