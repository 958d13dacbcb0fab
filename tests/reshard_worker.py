"""One rank of tests/test_meta_start.py's multi-process checks, under ``python -m torch.distributed.run``:

--measure DIR JSON  build the trainer of a mid-size Mixtral-shaped config (`MEASURE_SETS`) without training;
                    this rank's materialized parameter bytes and peak-RSS growth into JSON (rank<r>.json)
--fresh DIR         build the tiny trainer of `TINY_SETS` and checkpoint it at step 0 (its initial weights)
--resume DIR        resume the run in DIR (written at another layout) and checkpoint again at its step:
                    what this layout loaded, written back, for the test to compare with what was written
--set KEY=VALUE     the layout of this launch (parallel.ep_size, parallel.dp_mode)
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

from moe_core.train.build import materialized_bytes
from moe_core.train.checkpoint import latest_checkpoint
from moe_core.train.config import TrainConfig
from moe_core.train.loop import Trainer

TINY_SETS = [
    "steps=2",
    "batch_size=8",
    "data.source=synthetic",
    "data.seq_len=32",
    "data.synthetic_blocks=64",
    "checkpoint.every=2",
    "checkpoint.export=false",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "log.progress=off",
]
# Mixtral-8x7B's shape (8 experts, top-2, GQA 4:1, expert width 3.5 x hidden, 32k vocabulary) at 2 layers and
# hidden 1024: 0.35 G expert + 0.08 G dense parameters, 1.7 GB in fp32; a rank at ep 2 owns half the experts
MEASURE_SETS = [
    "model.overrides.hidden_size=1024",
    "model.overrides.num_hidden_layers=2",
    "model.overrides.num_attention_heads=8",
    "model.overrides.num_key_value_heads=2",
    "model.overrides.expert_intermediate_size=3584",
    "model.overrides.vocab_size=32000",
    "data.source=synthetic",
    "data.seq_len=16",
    "data.synthetic_blocks=32",
    "batch_size=4",
    "log.progress=off",
]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--measure", nargs=2, metavar=("DIR", "JSON"))
    p.add_argument("--fresh")
    p.add_argument("--resume")
    p.add_argument("--set", dest="sets", action="append", default=[])
    args = p.parse_args()
    trainers = []
    try:
        if args.measure:
            out, report = map(Path, args.measure)
            config = TrainConfig.from_preset("mixtral-tiny").with_overrides(MEASURE_SETS + args.sets)
            before = peak_rss_bytes()
            trainer = Trainer(config, out)
            trainers.append(trainer)
            row = {"materialized": materialized_bytes(trainer.model), "rss_growth": peak_rss_bytes() - before}
            rank = trainer.state.rank
            report.mkdir(parents=True, exist_ok=True)
            (report / f"rank{rank}.json").write_text(json.dumps(row))
        if args.fresh:
            config = TrainConfig.from_preset("mixtral-tiny").with_overrides(TINY_SETS + args.sets)
            trainer = Trainer(config, args.fresh)
            trainers.append(trainer)
            trainer.save_checkpoint()
        if args.resume:
            written = TrainConfig.load(
                latest_checkpoint(Path(args.resume) / "checkpoints") / "train_config.json"
            )
            trainer = Trainer(written.with_overrides(args.sets), args.resume, resume=True)
            trainers.append(trainer)
            trainer.save_checkpoint()
    finally:
        for trainer in reversed(trainers):
            trainer.close()


if __name__ == "__main__":
    main()
