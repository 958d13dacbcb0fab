"""The training loop: one process or many (expert x data parallel), exact resume, telemetry, fault handling.

    from moe_core.train import TrainConfig, train
    result = train(TrainConfig.from_preset("switch-tiny", steps=50), "runs/switch-tiny")

One optimizer step (in the spirit of torchtitan's `train.py`):
1. the next global batch of block indices; this rank's micro-batches are its slice of it (`batches.py`);
2. per micro-batch: forward under autocast with routing records, loss = lm + aux_coef * aux + z_coef * z
   (the model adds them), divided by grad_accum, backward (DDP syncs replicated grads on the last one);
3. expert grads summed over their data-parallel group; the global grad norm; a non-finite loss or norm skips
   the step (counted; more than `faults.max_bad_steps_in_a_row` in a row stops the run, naming the last
   checkpoint whose weights still gave a finite step);
4. clip, AdamW step, LR schedule step, then the aux-loss-free router bias update with the load all-reduced
   over every rank.
Where the native step and DeepSpeed's differ (wrapping, backward, the gradient average, clipping and the
step of 2-4, the optimizer's state) the trainer calls its backend (`backends.py`): under
``parallel.backend=deepspeed`` a DeepSpeed engine does them (ZeRO 1-2, `deepspeed_engine.py`); the rest is the same.
Every `log.every` steps: losses, LR, grad norm (averaged over the interval's finite steps: `interval.py`),
tokens/s, FLOPs and MFU, per-layer routing statistics, to the JSONL event file, the console and any extra
`MetricsSink`. Every `checkpoint.every` steps, at the end and on SIGTERM or SIGINT (Ctrl-C; a second one stops at
once, without one): an atomic checkpoint (`checkpoint.py`), only ever right after a good (finite) step: one that
falls due on a skipped step waits for the next good one.
At the end: a Hugging Face export in ``<out>/final``. AdamW and the LR schedule are built in `optim.py`.

The output directory is locked for the life of the run (`moe_core.fileio.OutputLock`, held by rank 0): a second
run on the same directory stops with a clear error. On resume, the newest checkpoint that passes its manifest's
checks is used (a damaged newer one is passed over with a warning), and ``metrics.jsonl`` rows past it are
dropped, so the file holds each step once.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moe_core.errors import MoELabError
from moe_core.eval.perplexity import perplexity
from moe_core.fileio import OutputLock, refuse_previous_outputs
from moe_core.flops import flops_per_token, peak_flops
from moe_core.init_from import checkpoint_tokenizer, load_initial
from moe_core.router_losses import LoadBalance
from moe_core.train import backends
from moe_core.train import checkpoint as ckpt_io
from moe_core.train import parallel as par
from moe_core.train.alerts import RoutingMonitor
from moe_core.train.batches import (
    GlobalBatches,
    adopt_data_seq_len,
    data_special_token_ids,
    open_datasets,
    rank_slice,
    stack_blocks,
)
from moe_core.train.build import build_meta_model, materialize_owned
from moe_core.train.config import TrainConfig, TrainConfigError
from moe_core.train.interval import LogInterval
from moe_core.train.launch import restart_count
from moe_core.train.optim import lr_lambda
from moe_core.train.telemetry import (
    RANK_FILE,
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    RoutingStats,
    max_memory_mb,
    rank_row,
    read_jsonl,
    reset_peak_memory,
)
from moe_core.upcycle import load_upcycled

# Signals that ask a run to stop after the step, with a checkpoint (a scheduler's SIGTERM, Ctrl-C's SIGINT);
# `TrainResult.stopped_by` names the one received
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingDivergedError(MoELabError):
    """Too many steps in a row with a non-finite loss or gradient."""


class OutOfMemoryError(MoELabError):
    """The device ran out of memory; the message names the batch settings to change."""


METRICS_FILE = "metrics.jsonl"  # <out>/: the event file (one JSON row per logging step, eval and alert)
EXPORT_DIR = "final"  # <out>/: the Hugging Face export of the last checkpoint


@dataclass
class TrainResult:
    out_dir: Path
    step: int  # optimizer steps done
    tokens: int  # training tokens seen (global)
    loss: float | None  # mean training loss over the last logging interval
    val_loss: float | None
    skipped_steps: int
    checkpoint: Path | None  # the last checkpoint written
    export_dir: Path | None
    metrics_path: Path
    stopped_by: str | None = None  # "SIGTERM" or "SIGINT" when a signal stopped the run early
    history: list[dict] = field(default_factory=list)  # the logged metrics (rank 0)
    data_dir: Path | None = (
        None  # the prepared data trained on (with its tokenizer/); None for synthetic data
    )

    @property
    def exit_code(self) -> int:
        """The exit status a command reports for this run: 0, or 128 + the signal's number when a signal stopped
        it (143 for SIGTERM, 130 for SIGINT), as a shell does, so schedulers and flows see it did not finish."""
        return 128 + signal.Signals[self.stopped_by].value if self.stopped_by else 0


def train(
    config: TrainConfig, out_dir: str | Path, resume: bool = False, sinks: list[MetricsSink] | None = None
) -> TrainResult:
    """Train (or with ``resume=True`` continue) a model as `config` says; write everything under `out_dir`."""
    trainer = Trainer(config, out_dir, resume=resume, sinks=sinks)
    try:
        return trainer.run()
    finally:
        trainer.close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# the micro-batch losses a step sums and all-reduces in one float64 tensor, in this order
STEP_LOSSES = ("loss", "lm_loss", "aux_loss", "z_loss")


class Trainer:
    """One pretraining run: `__init__` builds it (or restores it from the newest checkpoint), `run` trains to
    ``config.steps``, `close` releases the output directory and the process group. Sections below: setup,
    checkpoints, one optimizer step, evaluation, logging, the run."""

    def __init__(
        self,
        config: TrainConfig,
        out_dir: str | Path,
        resume: bool = False,
        sinks: list[MetricsSink] | None = None,
    ) -> None:
        self.config = config = adopt_data_seq_len(config)
        self.out_dir = Path(out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.extra_sinks = list(sinks or [])
        self.sinks: list[MetricsSink] = []
        self.lock: OutputLock | None = None
        self._discarded: list[str] = []  # half-written checkpoints rank 0 removed when it took the directory
        self.monitor: RoutingMonitor | None = None  # rank 0's routing alerts and load log
        self.state = par.init_parallel(config.parallel.ep_size, config.parallel.backend, config.device)
        # native or DeepSpeed: wrapping, backward, step and optimizer state (`backends.py`)
        self.backend = backends.for_config(config, self.state)
        reset_peak_memory(self.state.device)  # max_memory_mb is this run's peak, the model's weights included
        self._determinism = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        try:
            self._setup(resume)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------ setup
    def _setup(self, resume: bool) -> None:
        config, state = self.config, self.state
        if config.precision == "fp16" and state.device.type != "cuda":
            raise TrainConfigError("precision=fp16 needs CUDA (loss scaling); use precision=bf16 on CPU")
        if config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.micro_batch = config.micro_batch_size(state.world_size)
        resume_from = self._claim_output_dir(resume)
        # the order below fixes the random streams (data, then the seed, then the weights): keep it
        self._open_data()
        self._build_model(load_start=resume_from is None)
        self._build_optimization()
        self._build_telemetry()

        self.step = 0
        self.tokens = 0
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.best: dict | None = None
        self.last_checkpoint: Path | None = None
        self.last_val_loss: float | None = None
        self._stop_signal: str | None = None
        if resume_from is not None:
            self._load_checkpoint(resume_from)
        if resume and state.is_main:
            self._announce_resume(resume_from)

    def _claim_output_dir(self, resume: bool) -> Path | None:
        """Lock the output directory (rank 0) and return the checkpoint to resume from, if any. Without
        ``resume``, an earlier run's checkpoints are refused; with it, the checkpoint must come from a run with the
        same model, data and parallel sections."""
        state = self.state
        if state.is_main:  # one run per output directory: rank 0 holds the lock until close()
            self.lock = OutputLock(self.out_dir, "training run").acquire()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._discarded = ckpt_io.clean_temporary(self.ckpt_root)
        par.barrier(state)
        resume_from = None
        if resume:
            resume_from = self._resume_checkpoint()
        else:
            refuse_previous_outputs(
                self.out_dir,
                ("checkpoints/step_*",),
                "pass --resume (resume=True) to continue that run",
                what="checkpoints",
            )
        if resume_from is not None:
            saved = TrainConfig.load(resume_from / "train_config.json")
            # the layout (parallel.ep_size, parallel.dp_mode, the number of processes) may change: checkpoints
            # reshard (`checkpoint.py`); the backend may not (DeepSpeed keeps its own optimizer format)
            layout = {"ep_size", "dp_mode"}
            for section in ("model", "data", "parallel"):
                exclude = layout if section == "parallel" else set()
                if getattr(saved, section).model_dump(exclude=exclude) != getattr(
                    self.config, section
                ).model_dump(exclude=exclude):
                    raise MoELabError(
                        f"resume from {resume_from}: the `{section}` section differs from the run "
                        f"that wrote it; resume with its train_config.json (--set may change "
                        f"steps, optim, log, eval and checkpoint settings, and parallel.ep_size, "
                        f"parallel.dp_mode and --nproc)"
                    )
        return resume_from

    def _announce_resume(self, resume_from: Path | None) -> None:
        """Rank 0, on ``--resume``: one line saying which checkpoint and step the run continues from (or that it
        starts at step 0) and which half-written checkpoint (``.tmp-step_N``, a writer killed mid-save) it
        discarded."""
        if resume_from is not None:
            line = f"moe-lab train: resuming from {resume_from} (step {self.step})"
        else:
            line = f"moe-lab train: no complete checkpoint in {self.ckpt_root}; starting from step 0"
        if self._discarded:
            line += f"; discarded the half-written {', '.join(self._discarded)}"
        print(line, flush=True)

    def _open_data(self) -> None:
        """The training and validation blocks; the data's tokenizer fixes the model's vocabulary and its BOS,
        EOS and PAD ids (written into every checkpoint's config.json, so generation stops at EOS)."""
        config, state = self.config, self.state
        model_vocab = config.model.build_config().vocab_size
        tokenizer = None  # a run that starts from a checkpoint: text is tokenized as that model was trained
        start = config.model.start_from
        if start is not None and config.data.source != "synthetic" and config.data.path is None:
            field = "upcycle_from" if config.model.upcycle_from else "init_from"
            tokenizer = checkpoint_tokenizer(start, field)
        self.train_data, self.val_data, self.data_dir, vocab = open_datasets(
            config.data, self.out_dir, model_vocab, state.is_main, lambda: par.barrier(state), tokenizer
        )
        self.model_config = config.model.build_config(vocab_size=vocab)
        for name, token_id in data_special_token_ids(self.train_data).items():
            if name not in config.model.overrides:  # an id set in model.overrides is the user's choice
                setattr(self.model_config, name, token_id)
        if self.model_config.max_position_embeddings < config.data.seq_len:
            self.model_config.max_position_embeddings = config.data.seq_len

    def _build_model(self, load_start: bool = True) -> None:
        """``self.model`` (the plain module: state dicts, routers, eval). With ``model.upcycle_from`` or
        ``model.init_from`` (and ``load_start``: not when a checkpoint is resumed), each rank then copies in its part
        of that checkpoint."""
        config, state = self.config, self.state
        seed_everything(config.seed)  # the same random streams on every rank
        # built on the meta device and laid out before anything is allocated: each rank then materializes and
        # initializes only what it owns (`build.py`: the same initial weights at every layout for a seed)
        model = build_meta_model(self.model_config)
        if config.activation_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # the load-balancing statistics' scope: every rank's tokens are its own, so the data-parallel group of
        # the router losses is the world (expert-parallel peers route different tokens too)
        model.load_balance = LoadBalance(
            config.balance_scope, torch.distributed.group.WORLD if state.distributed else None
        )
        model = par.apply_expert_parallel(model, state)
        # FSDP2 shards it while still on meta: each rank then allocates its shards only
        model = self.backend.shard(model)
        self.model = materialize_owned(model, state.device, config.seed)
        if load_start and config.model.upcycle_from is not None:
            load_upcycled(self.model, config.model.upcycle_from)  # this rank's experts / FSDP2 rows only
        elif load_start and config.model.init_from is not None:
            load_initial(self.model, config.model.init_from)

    def _build_optimization(self) -> None:
        """``self.forward_model`` (what the training forward runs: compiled and data-parallel-wrapped as
        configured, or DeepSpeed's engine) and the AdamW it steps, the LR schedule and the order of the
        training batches."""
        config = self.config
        self.forward_model, self.optimizer = self.backend.wrap(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.batches = GlobalBatches(len(self.train_data), config.batch_size, config.seed)

    def _build_telemetry(self) -> None:
        """Routing statistics per MoE layer and the FLOPs figures behind tokens/s, TFLOPs and MFU."""
        config, state = self.config, self.state
        self.moe_layer_ids = self.model_config.moe_layer_ids
        self.routing = RoutingStats(len(self.moe_layer_ids), max(self.model_config.num_experts, 1))
        self.flops_per_token = flops_per_token(self.model_config, config.data.seq_len).training_active
        self.peak_flops = config.log.peak_flops or (
            peak_flops(torch.cuda.get_device_name(state.device)) if state.device.type == "cuda" else None
        )

    # ------------------------------------------------------------------------------------ checkpoints
    def _resume_checkpoint(self) -> Path | None:
        """Rank 0 picks the newest verified checkpoint (`select_resume_checkpoint`); every rank takes the same."""
        st = self.state
        chosen = ckpt_io.select_resume_checkpoint(self.ckpt_root) if st.is_main else None
        step = torch.tensor(
            [float(ckpt_io.step_of(chosen)) if chosen is not None else -1.0], dtype=torch.float64
        )
        if st.distributed:
            par.all_reduce_(step, st, op=torch.distributed.ReduceOp.MAX)
        return None if step.item() < 0 else self.ckpt_root / ckpt_io.step_dir_name(int(step.item()))

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "skipped_steps": self.skipped_steps,
            "bad_in_row": self.bad_in_row,
            "best": self.best,
            "val_loss": self.last_val_loss,
            "world_size": self.state.world_size,
            "ep_size": self.state.ep_size,
            "dp_mode": self.config.parallel.dp_mode,
            "tokenizer": str(self.data_dir / "tokenizer") if self.data_dir else None,
            "data_dir": str(self.data_dir) if self.data_dir else None,
        }

    def save_checkpoint(self) -> Path:
        st = self.state
        for name, param in self.model.named_parameters():  # never write bad weights
            if not torch.isfinite(par.local(param)).all():
                raise TrainingDivergedError(
                    f"parameter {name} holds non-finite values at step {self.step}; "
                    f"not checkpointing. Lower optim.lr or enable optim.grad_clip"
                )
        final = self.ckpt_root / ckpt_io.step_dir_name(self.step)
        tmp = ckpt_io.begin_checkpoint(self.ckpt_root, self.step)
        try:
            if st.is_main:
                ckpt_io.write_configs(tmp, self.config, self.model_config)
            par.barrier(st)
            ckpt_io.save_rank_files(
                tmp,
                self.model,
                self.optimizer,
                rank=st.rank,
                ep_rank=st.ep_rank,
                ep_size=st.ep_size,
                dp_rank=st.dp_rank,
                write_replicated=st.is_main,
                scheduler=self.scheduler,
                data_state=self.batches.state_dict(),
                scaler=self.backend.scaler,
                optimizer_in_rank_file=self.backend.optimizer_in_rank_file,  # DeepSpeed's own per-rank format
            )
            par.barrier(st)
            if st.is_main:
                val = self.last_val_loss
                if val is not None and (self.best is None or val < self.best["val_loss"]):
                    self.best = {"name": final.name, "step": self.step, "val_loss": val}
                ckpt_io.finish_checkpoint(tmp, final, self._trainer_state())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk, say: give the space back
            raise
        if st.is_main:
            keep_best = self.best["name"] if (self.best and self.config.checkpoint.keep_best) else None
            ckpt_io.prune_checkpoints(self.ckpt_root, self.config.checkpoint.keep_last, keep_best)
        par.barrier(st)
        self.last_checkpoint = final
        return final

    def _load_checkpoint(self, ckpt: Path) -> None:
        """Weights, optimizer state and the rest from ``ckpt``; at another layout than the one that wrote it, each
        rank reads its slice of the weights and optimizer state (`checkpoint.py`: resharding)."""
        st = self.state
        saved = ckpt_io.read_trainer_state(ckpt)
        written_dp_mode = saved.get("dp_mode", self.config.parallel.dp_mode)
        same_layout = (saved["world_size"], saved["ep_size"]) == (st.world_size, st.ep_size) and (
            st.world_size == 1 or written_dp_mode == self.config.parallel.dp_mode  # one process: no dp at all
        )
        # at its own layout each rank takes back its own file (its RNG state: a bitwise resume); else the file
        # of the same rank number, or rank 0's (the data position, scheduler and scaler are the same in all)
        rank_state = ckpt_io.load_rank_files(ckpt, st.rank if st.rank < saved["world_size"] else 0)
        per_rank_optimizer = rank_state.get("optimizer") is not None  # format 2, or DeepSpeed's own
        if not same_layout and per_rank_optimizer:
            raise ckpt_io.CheckpointError(
                f"{ckpt} was written by {saved['world_size']} processes with ep_size={saved['ep_size']}, "
                f"dp_mode={written_dp_mode}, in a format that keeps the optimizer state per rank "
                f"(format 2, or parallel.backend=deepspeed); resume with the same --nproc and parallel settings"
            )
        ckpt_io.load_model_state(self.model, ckpt)
        if per_rank_optimizer:
            ckpt_io.load_optimizer_state(self.optimizer, rank_state["optimizer"])
        else:
            ckpt_io.load_optimizer_tensors(self.model, self.optimizer, ckpt, rank_state["optimizer_groups"])
        self.backend.after_load()  # DeepSpeed: its fp32 master copies of the weights just loaded
        self._load_scheduler(rank_state["scheduler"])
        self.batches.load_state_dict(rank_state["data"])
        if self.backend.scaler is not None and rank_state["scaler"]:
            self.backend.scaler.load_state_dict(rank_state["scaler"])
        self.step, self.tokens = saved["step"], saved["tokens"]
        self.skipped_steps, self.bad_in_row = saved["skipped_steps"], saved["bad_in_row"]
        self.best, self.last_val_loss = saved["best"], saved["val_loss"]
        ckpt_io.set_rng_state(rank_state["rng"])
        self.last_checkpoint = ckpt

    def _load_scheduler(self, saved: dict) -> None:
        """The LR schedule's position. A layout with other optimizer groups (FSDP2 keeps its DTensors apart) keeps
        its own base LRs, and each group's LR is what the schedule gives at that step (LambdaLR's formula)."""
        if len(saved["base_lrs"]) == len(self.scheduler.base_lrs):
            self.scheduler.load_state_dict(saved)
            return
        factor = lr_lambda(self.config)(saved["last_epoch"])
        lrs = [base * factor for base in self.scheduler.base_lrs]
        self.scheduler.load_state_dict({**saved, "base_lrs": list(self.scheduler.base_lrs), "_last_lr": lrs})
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr

    # ------------------------------------------------------------------------------------ one step
    def _autocast(self):
        if self.config.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self.state.device.type, dtype=dtype)

    def _oom_error(self) -> OutOfMemoryError:
        c = self.config
        return OutOfMemoryError(
            f"out of memory on {self.state.device} at step {self.step} with batch_size={c.batch_size}, "
            f"grad_accum={c.grad_accum} ({self.micro_batch} sequences per process per micro-step), "
            f"data.seq_len={c.data.seq_len}, precision={c.precision}, "
            f"activation_checkpointing={c.activation_checkpointing}. Raise grad_accum (same global batch), "
            f"lower batch_size or data.seq_len, set activation_checkpointing=true or precision=bf16"
        )

    def train_step(self) -> dict[str, float]:
        """One optimizer step (the module docstring lists its parts); returns its losses, grad norm, LR and
        whether it was finite (a skipped step's values are not a loss of the model, see `LogInterval`)."""
        config, state = self.config, self.state
        indices = self.batches.next_batch()
        if self.model.load_balance is not None:
            self.model.load_balance.reset()  # a new global batch
        loss_sums = self._accumulate_gradients(indices)
        # complete gradients and their norm (DeepSpeed clips and steps here, or skips a non-finite gradient)
        grad_norm = self.backend.finish_gradients(self.model)
        mean_losses = par.all_reduce_(loss_sums / (config.grad_accum * state.world_size), state)
        finite = bool(torch.isfinite(mean_losses).all() and torch.isfinite(grad_norm))
        loads = self._router_loads()
        if finite:
            self._apply_update(grad_norm)
        else:
            self._skip_update(losses_finite=bool(torch.isfinite(mean_losses).all()))
            loads = [None if load is None else torch.zeros_like(load) for load in loads]
        self.model.update_router_biases(loads)
        self.backend.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        self.tokens += config.batch_size * config.data.seq_len
        losses = dict(zip(STEP_LOSSES, (value.item() for value in mean_losses), strict=True))
        if self.bad_in_row > config.faults.max_bad_steps_in_a_row:
            raise self._diverged_error(losses["loss"], grad_norm.item())
        out = {**losses, "grad_norm": grad_norm.item(), "lr": lr, "finite": float(finite)}
        if state.distributed:  # this rank's own loss, for its per-rank figures (`telemetry.rank_row`)
            out["rank_loss"] = loss_sums[0].item() / config.grad_accum
        return out

    def _accumulate_gradients(self, indices: list[int]) -> torch.Tensor:
        """Forward and backward over this rank's ``grad_accum`` micro-batches of the global batch ``indices``;
        returns the sums of the micro-batch mean losses (float64, in `STEP_LOSSES` order) and collects the routing
        statistics. Data-parallel gradients sync on the last micro-batch only."""
        config, state = self.config, self.state
        loss_sums = torch.zeros(len(STEP_LOSSES), dtype=torch.float64)
        for micro in range(config.grad_accum):
            ids_BS = stack_blocks(
                self.train_data, rank_slice(indices, micro, state.rank, state.world_size, self.micro_batch)
            )
            ids_BS = ids_BS.to(state.device, non_blocking=True)
            last = micro == config.grad_accum - 1
            with self.backend.accumulating(self.forward_model, self.model, last):
                with self._autocast():
                    out = self.forward_model(
                        input_ids=ids_BS, labels=ids_BS, output_routing=True, use_cache=False
                    )
                self.backend.backward(out.loss, last)  # of the mean over this rank's grad_accum micro-batches
            parts = [out.loss, out.lm_loss, out.aux_loss, out.z_loss]  # STEP_LOSSES
            loss_sums += torch.tensor(
                [0.0 if p is None else p.detach().float().item() for p in parts], dtype=torch.float64
            )
            if out.routing:
                self.routing.add(out.routing)
        return loss_sums

    def _apply_update(self, grad_norm: torch.Tensor) -> None:
        """A finite step: clip to ``optim.grad_clip`` by the global norm, then the optimizer (or scaler) step
        (under DeepSpeed both happened in `finish_gradients`)."""
        self.bad_in_row = 0
        self.backend.apply_update(self.model, grad_norm)

    def _skip_update(self, losses_finite: bool) -> None:
        """A non-finite step: no update, counted. Under fp16 a finite loss with an overflowing gradient is the
        loss scale's fault, so the scaler backs off instead of the step counting towards divergence."""
        self.skipped_steps += 1
        if self.backend.skip_update(losses_finite):
            self.bad_in_row += 1

    def _diverged_error(self, loss: float, grad_norm: float) -> TrainingDivergedError:
        good = self._last_good_checkpoint()
        return TrainingDivergedError(
            f"step {self.step}: {self.bad_in_row} steps in a row had a non-finite loss or gradient "
            f"(last loss {loss}, grad norm {grad_norm}); stopped without checkpointing. "
            f"Lower optim.lr, keep optim.grad_clip on, try precision=fp32, or "
            + (
                f"resume from {good} (the last checkpoint whose weights still gave a finite step) with a fix: "
                f"move the newer checkpoints away and pass --resume"
                if good is not None
                else "start again with a fix (no checkpoint before the divergence gave a finite step)"
            )
        )

    def _last_good_checkpoint(self) -> Path | None:
        """The newest checkpoint whose weights were followed by a finite step. The current streak of
        ``bad_in_row`` skipped steps began at step ``self.step - bad_in_row + 1``, computed from the weights
        after step ``self.step - bad_in_row``: a checkpoint of that step holds the weights that diverged."""
        limit = self.step - self.bad_in_row - 1
        good = [p for p in ckpt_io.list_checkpoints(self.ckpt_root) if ckpt_io.step_of(p) <= limit]
        return good[-1] if good else None

    def _router_loads(self) -> list[torch.Tensor | None]:
        """Per router, the expert load seen this step (aux-loss-free bias), summed over every rank."""
        routers = self.model.routers()
        loads = [getattr(r, "pending_load", None) for r in routers]
        present = [load for load in loads if load is not None]
        if present and self.state.distributed:
            stacked = torch.stack([load.float() for load in present])
            par.all_reduce_(stacked, self.state)
            reduced = iter(stacked)
            loads = [None if load is None else next(reduced).to(load) for load in loads]
        return loads

    # ------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean LM loss (and perplexity) over the first ``eval.batches`` validation batches, every rank its slice;
        {} without validation data. Runs the plain module in eval mode: no router state moves."""
        if self.val_data is None:
            return {}
        config, state = self.config, self.state
        batch_size = config.eval.batch_size or self.micro_batch
        per_batch = batch_size * state.world_size  # sequences per evaluation batch, over every rank
        n_batches = min(config.eval.batches, len(self.val_data) // per_batch)
        if n_batches == 0:
            return {}
        self.model.eval()
        loss_sum_and_batches = torch.zeros(2, dtype=torch.float64)  # all-reduced together
        try:
            for batch in range(n_batches):
                indices = list(range(batch * per_batch, (batch + 1) * per_batch))
                ids_BS = stack_blocks(
                    self.val_data, rank_slice(indices, 0, state.rank, state.world_size, batch_size)
                ).to(state.device)
                with self._autocast():
                    out = self.model(input_ids=ids_BS, labels=ids_BS, use_cache=False)
                loss_sum_and_batches += torch.tensor([out.lm_loss.float().item(), 1.0], dtype=torch.float64)
        finally:
            self.model.train()
        par.all_reduce_(loss_sum_and_batches, state)
        loss_sum, batches = loss_sum_and_batches
        val_loss = (loss_sum / batches).item()
        self.last_val_loss = val_loss
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}

    def _evaluate_if_due(self, last_step: bool) -> dict[str, float]:
        every = self.config.eval.every
        return self.evaluate() if (every and self.step % every == 0) or last_step else {}

    # ------------------------------------------------------------------------------------ logging
    def _open_sinks(self) -> None:
        if (
            not self.state.is_main
        ):  # a non-zero rank: its own small event file (`rank_row`), for the dashboard
            path = self.out_dir / RANK_FILE.format(rank=self.state.rank)
            self.sinks = [JsonlSink(path, start_step=self.step)]
            return
        self.metrics_path = self.out_dir / METRICS_FILE
        self.sinks = [JsonlSink(self.metrics_path, start_step=self.step)]  # rows past a resumed step: dropped
        self.monitor = RoutingMonitor(
            self.out_dir,
            self.moe_layer_ids,
            self.model_config.num_experts,
            self.config.log.alerts,
            self.model.routers(),
            self.routing,
            self.step,
            self.config.log.per_expert,
        )
        if self.config.log.progress != "off":
            self.sinks.append(
                ConsoleSink(
                    self.config.steps, self.step, self.config.log.progress, log_every=self.config.log.every
                )
            )
        self.sinks.extend(self.extra_sinks)

    def _on_step(self) -> None:
        for sink in self.sinks:  # the progress bar moves every step, not only at logging steps
            if hasattr(sink, "on_step"):
                sink.on_step(self.step)

    def _publish(self, metrics: dict[str, float], history: list[dict]) -> None:
        """Rank 0: routing alerts and the load log (`RoutingMonitor`), then every sink and the history."""
        metrics.update(self.monitor.observe(self.step, metrics))  # alerts, biases, load log
        for sink in self.sinks:
            sink.log(self.step, metrics)
        history.append({"step": self.step, **metrics})

    def _publish_rank(self, metrics: dict[str, float]) -> None:
        """A non-zero rank: its own figures of the logged row (step time, memory, all-to-all) into its file."""
        for sink in self.sinks:
            sink.log(self.step, rank_row(metrics, self.state.rank))

    def _interval_metrics(self, interval: LogInterval, lr: float) -> dict[str, float]:
        """The logged row for the steps since the last one (collective: every rank calls it)."""
        out = interval.means()
        if out and not self.moe_layer_ids:
            del out["aux_loss"], out["z_loss"]
        out["lr"] = lr
        out.update(self._throughput_metrics(interval))
        out["skipped_steps"] = float(self.skipped_steps)
        out.update(par.comm_metrics(self.model, self.state, interval.steps, interval.seconds))
        if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":  # under torchrun's elastic agent
            out["elastic/restarts"] = float(restart_count())
        if self.moe_layer_ids:
            if self.state.distributed:
                par.all_reduce_(self.routing.sums_LX, self.state)
            out.update(self.routing.metrics(self.moe_layer_ids, self.config.log.per_expert))
            self.routing.reset()
        return out

    def _throughput_metrics(self, interval: LogInterval) -> dict[str, float]:
        """Tokens/s, step time, tokens seen, and FLOPs per token, achieved TFLOPs per device and MFU
        (`flops.flops_per_token`; MFU where the device's peak is known or ``log.peak_flops`` is set)."""
        config = self.config
        tokens = interval.steps * config.batch_size * config.data.seq_len
        seconds = max(interval.seconds, 1e-9)
        achieved = self.flops_per_token * tokens / seconds / self.state.world_size  # per device
        out = {
            "tokens_per_s": tokens / seconds,
            "step_time_s": seconds / max(interval.steps, 1),
            "tokens": float(self.tokens),
            "flops_per_token": self.flops_per_token,
            "tflops_per_device": achieved / 1e12,
            "max_memory_mb": max_memory_mb(self.state.device),
        }
        if self.peak_flops:
            out["mfu"] = achieved / self.peak_flops
        return out

    # ------------------------------------------------------------------------------------ the run
    def _on_signal(self, signum, frame) -> None:
        """SIGTERM or SIGINT (Ctrl-C): finish the step, checkpoint, stop (`run`). A Ctrl-C after that stops at
        once, without a checkpoint (KeyboardInterrupt, as Python's own); a SIGTERM after it changes nothing.
        Under torchrun neither does a second SIGINT: its agent passes the terminal's Ctrl-C on to the workers,
        which got it from the terminal already (the agent itself kills them when they take too long)."""
        name = signal.Signals(signum).name
        if self._stop_signal is not None:
            if signum != signal.SIGINT or "TORCHELASTIC_RUN_ID" in os.environ:
                return
            self._say(
                f"moe-lab train: {name} again: stopping now, without a checkpoint; the last one is "
                f"{self.last_checkpoint}"
            )
            raise KeyboardInterrupt
        self._stop_signal = name
        again = "" if "TORCHELASTIC_RUN_ID" in os.environ else " (Ctrl-C again stops at once, without one)"
        self._say(f"moe-lab train: {name}: finishing this step, then saving a checkpoint and stopping{again}")

    def _say(self, line: str) -> None:
        """Rank 0: one line on stderr, written straight to its file descriptor: safe inside a signal handler,
        which may run while the main thread is in the middle of a print."""
        if self.state.is_main:
            os.write(2, (line + "\n").encode())

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM or SIGINT (collective: every rank stops at the same step)."""
        flag = torch.tensor([1.0 if self._stop_signal else 0.0])
        if self.state.distributed:
            par.all_reduce_(flag, self.state, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _timed_train_step(self) -> tuple[dict[str, float], float]:
        """`train_step` and its wall time (the device synchronized), an OOM turned into `OutOfMemoryError`."""
        started = time.perf_counter()
        try:
            stats = self.train_step()
        except torch.cuda.OutOfMemoryError:
            raise self._oom_error() from None
        if self.state.device.type == "cuda":
            torch.cuda.synchronize(self.state.device)
        return stats, time.perf_counter() - started

    def run(self) -> TrainResult:
        """Train to ``config.steps``: log every ``log.every`` steps (and at each evaluation), checkpoint every
        ``checkpoint.every`` steps, at the end and on SIGTERM or SIGINT (`STOP_SIGNALS`), then export ``<out>/final``."""
        config = self.config
        self.metrics_path = self.out_dir / METRICS_FILE
        self._open_sinks()
        history: list[dict] = []
        previous_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous_handlers[signum] = signal.signal(signum, self._on_signal)
        self.model.train()
        interval = LogInterval()
        last_loss = None  # the mean training loss of the last logged interval
        checkpoint_due = False  # a checkpoint fell due and waits for a finite step
        try:
            while self.step < config.steps:
                stats, seconds = self._timed_train_step()
                interval.add(stats, seconds)
                self._on_step()
                last_step = self.step == config.steps
                metrics = self._evaluate_if_due(last_step)
                if self.step % config.log.every == 0 or last_step or metrics:
                    metrics.update(self._interval_metrics(interval, stats["lr"]))
                    last_loss = metrics.get("loss", last_loss)
                    if self.state.is_main:
                        self._publish(metrics, history)
                    else:
                        self._publish_rank(metrics)
                    interval = LogInterval()
                stop = self._stop_requested()
                checkpoint_due = (
                    checkpoint_due or self.step % config.checkpoint.every == 0 or last_step or stop
                )
                if (
                    checkpoint_due and stats["finite"]
                ):  # never right after a skipped step: see _last_good_checkpoint
                    self.save_checkpoint()
                    checkpoint_due = False
                if stop:
                    self._announce_stop(checkpoint_saved=not checkpoint_due)
                    return self._result(last_loss, history, stopped_by=self._stop_signal or "SIGTERM")
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
        export_dir = self._export_final()
        par.barrier(self.state)
        return self._result(last_loss, history, export_dir=export_dir)

    def _announce_stop(self, checkpoint_saved: bool) -> None:
        if self.state.is_main:
            saved = "saved" if checkpoint_saved else "kept (the last step was skipped, not saved)"
            print(
                f"moe-lab train: {self._stop_signal or 'SIGTERM'} at step {self.step}: checkpoint "
                f"{self.last_checkpoint} {saved}; continue with --resume",
                flush=True,
            )

    def _export_final(self) -> Path | None:
        """Rank 0: the last checkpoint as a Hugging Face model in ``<out>/final`` (``checkpoint.export``)."""
        if not (self.config.checkpoint.export and self.state.is_main and self.last_checkpoint is not None):
            return None
        tokenizer = self.data_dir / "tokenizer" if self.data_dir else None
        return ckpt_io.export_checkpoint(self.last_checkpoint, self.out_dir / EXPORT_DIR, tokenizer)

    def _result(self, loss, history, export_dir=None, stopped_by=None) -> TrainResult:
        return TrainResult(
            self.out_dir,
            self.step,
            self.tokens,
            loss,
            self.last_val_loss,
            self.skipped_steps,
            self.last_checkpoint,
            export_dir,
            self.metrics_path,
            stopped_by,
            history,
            self.data_dir,
        )

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.monitor is not None:
            self.monitor.close()
        torch.use_deterministic_algorithms(self._determinism[0], warn_only=self._determinism[1])
        self.backend.close()  # DeepSpeed: releases its engine and ends the process group its way
        par.shutdown_parallel(self.state)
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def read_result(out_dir: str | Path) -> TrainResult:
    """The `TrainResult` of a run that finished in another process (torchrun, Ray, ``moe-lab train``), read
    from what it wrote into ``out_dir``: its last checkpoint's trainer state and its event file."""
    out_dir = Path(out_dir)
    checkpoint = ckpt_io.latest_checkpoint(out_dir / "checkpoints")
    if checkpoint is None:
        raise MoELabError(f"{out_dir}: no complete checkpoint under checkpoints/; the run did not finish one")
    state = ckpt_io.read_trainer_state(checkpoint)
    metrics_path = out_dir / METRICS_FILE
    history = read_jsonl(metrics_path) if metrics_path.is_file() else []
    last = next((row for row in reversed(history) if "loss" in row), {})
    export_dir = out_dir / EXPORT_DIR
    return TrainResult(
        out_dir,
        int(state["step"]),
        int(state["tokens"]),
        last.get("loss"),
        state.get("val_loss"),
        int(state.get("skipped_steps", 0)),
        checkpoint,
        export_dir if (export_dir / "config.json").is_file() else None,
        metrics_path,
        None,
        history,
        Path(state["data_dir"]) if state.get("data_dir") else None,
    )
