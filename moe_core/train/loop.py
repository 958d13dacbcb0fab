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
Every `log.every` steps: losses, LR, grad norm, tokens/s, FLOPs and MFU, per-layer routing statistics, to
the JSONL event file, the console and any extra `MetricsSink`. Every `checkpoint.every` steps, at the end and
on SIGTERM: an atomic checkpoint (`checkpoint.py`), only ever right after a good (finite) step: one that falls
due on a skipped step waits for the next good one. At the end: a Hugging Face export in ``<out>/final``.

The output directory is locked for the life of the run (`moe_core.fileio.OutputLock`, held by rank 0): a second
run on the same directory stops with a clear error. On resume, the newest checkpoint that passes its manifest's
checks is used (a damaged newer one is passed over with a warning), and ``metrics.jsonl`` rows past it are
dropped, so the file holds each step once.
"""

from __future__ import annotations

import contextlib
import math
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
from moe_core.fileio import OutputLock, refuse_previous_outputs
from moe_core.routing import GlobalBatchBalance
from moe_core.train import checkpoint as ckpt_io
from moe_core.train import parallel as par
from moe_core.train.alerts import RoutingMonitor
from moe_core.train.batches import GlobalBatches, adopt_data_seq_len, open_datasets, rank_slice, stack_blocks
from moe_core.train.config import TrainConfig, TrainConfigError
from moe_core.train.flops import flops_per_token, peak_flops
from moe_core.train.launch import restart_count
from moe_core.train.telemetry import ConsoleSink, JsonlSink, MetricsSink, RoutingStats, read_jsonl


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
    stopped_by: str | None = None  # "SIGTERM" when asked to stop early
    history: list[dict] = field(default_factory=list)  # the logged metrics (rank 0)
    data_dir: Path | None = (
        None  # the prepared data trained on (with its tokenizer/); None for synthetic data
    )


def train(
    config: TrainConfig, out_dir: str | Path, resume: bool = False, sinks: list[MetricsSink] | None = None
) -> TrainResult:
    """Train (or with ``resume=True`` continue) a model as `config` says; write everything under `out_dir`."""
    trainer = Trainer(config, out_dir, resume=resume, sinks=sinks)
    try:
        return trainer.run()
    finally:
        trainer.close()


def lr_lambda(config: TrainConfig):
    """Multiplier of the peak LR at each step: linear warmup, then cosine to ``min_lr_ratio`` or WSD
    (warmup-stable-decay, Hu et al. 2024 "MiniCPM": constant, then linear decay over the last fraction)."""
    o, total = config.optim, config.steps

    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        if o.schedule == "wsd":
            decay_steps = max(1, round(o.decay_fraction * total))
            decay_start = total - decay_steps
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start + 1) / decay_steps)
            return 1.0 - (1.0 - o.min_lr_ratio) * progress
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig, device: torch.device, allow_fused: bool = True
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases); fused kernel where this torch has one.
    FSDP2's DTensor parameters and plain ones (expert shards) go in separate groups: one foreach kernel
    cannot mix them."""
    buckets: dict[tuple[bool, bool], list] = {}
    for _, param in model.named_parameters():
        if param.requires_grad:
            buckets.setdefault((param.ndim >= 2, par.is_sharded(param)), []).append(param)
    groups = [
        {"params": params, "weight_decay": config.optim.weight_decay if decay else 0.0}
        for (decay, _), params in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
    ]
    kwargs = dict(lr=config.optim.lr, betas=config.optim.betas, eps=config.optim.eps)
    if config.optim.fused is False or (
        config.optim.fused is None and not allow_fused
    ):  # FSDP2: DTensor params
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError) as err:
        if config.optim.fused:
            raise TrainConfigError(
                f"optim.fused=true: no fused AdamW for {device.type} here ({err}); set optim.fused=null"
            ) from None
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
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
        self.monitor: RoutingMonitor | None = None  # rank 0's routing alerts and load log
        self.state = par.init_parallel(config.parallel.ep_size, config.parallel.backend, config.device)
        self._determinism = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        try:
            self._setup(resume)
        except BaseException:
            self.close()
            raise

    def _setup(self, resume: bool) -> None:
        config, st = self.config, self.state
        if config.precision == "fp16" and st.device.type != "cuda":
            raise TrainConfigError("precision=fp16 needs CUDA (loss scaling); use precision=bf16 on CPU")
        if config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.micro_batch = config.micro_batch_size(st.world_size)

        resume_from = None
        if st.is_main:  # one run per output directory: rank 0 holds the lock until close()
            self.lock = OutputLock(self.out_dir, "training run").acquire()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            ckpt_io.clean_temporary(self.ckpt_root)
        par.barrier(st)
        existing = ckpt_io.any_checkpoint_dir(self.ckpt_root)
        if resume:
            resume_from = self._resume_checkpoint()
            if resume_from is None and st.is_main and existing is None:
                print(
                    f"moe-lab train: no checkpoint in {self.ckpt_root} yet; starting from step 0", flush=True
                )
        else:
            refuse_previous_outputs(
                self.out_dir,
                ("checkpoints/step_*",),
                "pass --resume (resume=True) to continue that run",
                what="checkpoints",
            )
        if resume_from is not None:
            saved = TrainConfig.load(resume_from / "train_config.json")
            for section in ("model", "data", "parallel"):
                if getattr(saved, section) != getattr(config, section):
                    raise MoELabError(
                        f"resume from {resume_from}: the `{section}` section differs from the run "
                        f"that wrote it; resume with its train_config.json (--set may change "
                        f"steps, optim, log, eval and checkpoint settings)"
                    )

        # data first: the tokenizer fixes the vocabulary
        model_vocab = config.model.build_config().vocab_size
        self.train_data, self.val_data, self.data_dir, vocab = open_datasets(
            config.data, self.out_dir, model_vocab, st.is_main, lambda: par.barrier(st)
        )
        self.model_config = config.model.build_config(vocab_size=vocab)
        if self.model_config.max_position_embeddings < config.data.seq_len:
            self.model_config.max_position_embeddings = config.data.seq_len

        from moe_core.model import MoEForCausalLM

        seed_everything(config.seed)  # the same initial weights on every rank
        model = MoEForCausalLM(self.model_config)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        global_batch = config.balance_scope == "global_batch"
        if global_batch:  # f_e over every micro-batch of the step and every rank (`GlobalBatchBalance`)
            model.load_balance = GlobalBatchBalance(torch.distributed.group.WORLD if st.distributed else None)
        model = par.apply_expert_parallel(model, st, config.parallel.global_aux_loss and not global_batch)
        self.model = model.to(st.device)  # the plain module: state dicts, routers, eval
        self.forward_model = self.model
        if config.compile:
            self.forward_model = torch.compile(self.model)
        self.forward_model = par.wrap_data_parallel(self.forward_model, st, config.parallel.dp_mode)
        fsdp = st.distributed and config.parallel.dp_mode == "fsdp2"
        self.optimizer = build_optimizer(self.model, config, st.device, allow_fused=not fsdp)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.scaler = torch.amp.GradScaler("cuda") if config.precision == "fp16" else None
        self.batches = GlobalBatches(len(self.train_data), config.batch_size, config.seed)
        self.moe_layer_ids = self.model_config.moe_layer_ids
        self.routing = RoutingStats(len(self.moe_layer_ids), max(self.model_config.num_experts, 1))
        self.flops_per_token = flops_per_token(self.model_config, config.data.seq_len)
        self.peak_flops = config.log.peak_flops or (
            peak_flops(torch.cuda.get_device_name(st.device)) if st.device.type == "cuda" else None
        )

        self.step = 0
        self.tokens = 0
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.best: dict | None = None
        self.last_checkpoint: Path | None = None
        self.last_val_loss: float | None = None
        self._stop_signal: str | None = None
        if resume_from is not None:
            self._load(resume_from)

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
                scaler=self.scaler,
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

    def _load(self, ckpt: Path) -> None:
        st = self.state
        ckpt_io.load_model_state(self.model, ckpt, st.ep_rank, st.ep_size)
        rank_state = ckpt_io.load_rank_files(ckpt, st.rank)
        ckpt_io.load_optimizer_state(self.optimizer, rank_state["optimizer"])
        self.scheduler.load_state_dict(rank_state["scheduler"])
        self.batches.load_state_dict(rank_state["data"])
        if self.scaler is not None and rank_state["scaler"]:
            self.scaler.load_state_dict(rank_state["scaler"])
        saved = ckpt_io.read_trainer_state(ckpt)
        if saved["world_size"] != st.world_size or saved["ep_size"] != st.ep_size:
            raise ckpt_io.CheckpointError(
                f"{ckpt} was written by {saved['world_size']} processes with ep_size={saved['ep_size']}; resume "
                f"with the same --nproc and parallel.ep_size"
            )
        self.step, self.tokens = saved["step"], saved["tokens"]
        self.skipped_steps, self.bad_in_row = saved["skipped_steps"], saved["bad_in_row"]
        self.best, self.last_val_loss = saved["best"], saved["val_loss"]
        ckpt_io.set_rng_state(rank_state["rng"])
        self.last_checkpoint = ckpt

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
        c, st = self.config, self.state
        indices = self.batches.next_batch()
        if self.model.load_balance is not None:
            self.model.load_balance.reset()  # a new global batch
        sums = torch.zeros(4, dtype=torch.float64)  # loss, lm, aux, z: sums of micro-batch means
        for m in range(c.grad_accum):
            ids_BS = stack_blocks(
                self.train_data, rank_slice(indices, m, st.rank, st.world_size, self.micro_batch)
            )
            ids_BS = ids_BS.to(st.device, non_blocking=True)
            sync = (
                par.no_gradient_sync(self.forward_model, self.model)
                if m < c.grad_accum - 1
                else contextlib.nullcontext()
            )
            with sync:
                with self._autocast():
                    out = self.forward_model(
                        input_ids=ids_BS, labels=ids_BS, output_routing=True, use_cache=False
                    )
                loss = out.loss / c.grad_accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            parts = [out.loss, out.lm_loss, out.aux_loss, out.z_loss]
            sums += torch.tensor(
                [0.0 if p is None else p.detach().float().item() for p in parts], dtype=torch.float64
            )
            if out.routing:
                self.routing.add(out.routing)
        par.sync_expert_grads(self.model, st)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = par.global_grad_norm(self.model, st).cpu()
        losses = par.all_reduce_(sums / (c.grad_accum * st.world_size), st)
        finite = bool(torch.isfinite(losses).all() and torch.isfinite(grad_norm))
        loads = self._router_loads()
        if finite:
            if c.optim.grad_clip is not None and grad_norm > c.optim.grad_clip:
                scale = c.optim.grad_clip / (grad_norm.item() + 1e-6)
                for param in self.model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(scale)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.bad_in_row = 0
        else:
            self.skipped_steps += 1
            if (
                self.scaler is not None and torch.isfinite(losses).all()
            ):  # fp16 overflow: the scaler backs off
                self.scaler.update(self.scaler.get_scale() / 2)
            else:
                self.bad_in_row += 1
            loads = [None if load is None else torch.zeros_like(load) for load in loads]
        self.model.update_router_biases(loads)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        self.tokens += c.batch_size * c.data.seq_len
        if self.bad_in_row > c.faults.max_bad_steps_in_a_row:
            good = self._last_good_checkpoint()
            raise TrainingDivergedError(
                f"step {self.step}: {self.bad_in_row} steps in a row had a non-finite loss or gradient "
                f"(last loss {losses[0].item()}, grad norm {grad_norm.item()}); stopped without checkpointing. "
                f"Lower optim.lr, keep optim.grad_clip on, try precision=fp32, or "
                + (
                    f"resume from {good} (the last checkpoint whose weights still gave a finite step) with a fix: "
                    f"move the newer checkpoints away and pass --resume"
                    if good is not None
                    else "start again with a fix (no checkpoint before the divergence gave a finite step)"
                )
            )
        return {
            "loss": losses[0].item(),
            "lm_loss": losses[1].item(),
            "aux_loss": losses[2].item(),
            "z_loss": losses[3].item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "finite": float(finite),
        }

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
            it = iter(stacked)
            loads = [None if load is None else next(it).to(load) for load in loads]
        return loads

    # ------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.val_data is None:
            return {}
        c, st = self.config, self.state
        bs = c.eval.batch_size or self.micro_batch
        per_batch = bs * st.world_size
        n_batches = min(c.eval.batches, len(self.val_data) // per_batch)
        if n_batches == 0:
            return {}
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        try:
            for b in range(n_batches):
                indices = list(range(b * per_batch, (b + 1) * per_batch))
                ids_BS = stack_blocks(self.val_data, rank_slice(indices, 0, st.rank, st.world_size, bs)).to(
                    st.device
                )
                with self._autocast():
                    out = self.model(input_ids=ids_BS, labels=ids_BS, use_cache=False)
                total += torch.tensor([out.lm_loss.float().item(), 1.0], dtype=torch.float64)
        finally:
            self.model.train()
        par.all_reduce_(total, st)
        val_loss = (total[0] / total[1]).item()
        self.last_val_loss = val_loss
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    # ------------------------------------------------------------------------------------ the run
    def _open_sinks(self) -> None:
        if not self.state.is_main:
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
            self.sinks.append(ConsoleSink(self.config.steps, self.step, self.config.log.progress))
        self.sinks.extend(self.extra_sinks)

    def _log(self, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(self.step, metrics)

    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signal.Signals(signum).name

    def run(self) -> TrainResult:
        c, st = self.config, self.state
        self.metrics_path = self.out_dir / METRICS_FILE
        self._open_sinks()
        history: list[dict] = []
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_signal)
        self.model.train()
        interval = {"sums": np.zeros(6), "steps": 0, "time": 0.0}
        last_loss = None
        checkpoint_due = False
        try:
            while self.step < c.steps:
                t0 = time.perf_counter()
                try:
                    stats = self.train_step()
                except torch.cuda.OutOfMemoryError:
                    raise self._oom_error() from None
                if st.device.type == "cuda":
                    torch.cuda.synchronize(st.device)
                interval["time"] += time.perf_counter() - t0
                if stats["finite"]:
                    interval["sums"] += [
                        stats[k] for k in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")
                    ] + [1]
                interval["steps"] += 1
                for sink in self.sinks:  # the progress bar moves every step, not only at logging steps
                    if hasattr(sink, "on_step"):
                        sink.on_step(self.step)
                last_step = self.step == c.steps
                metrics: dict[str, float] = {}
                if c.eval.every and self.step % c.eval.every == 0 or last_step:
                    metrics.update(self.evaluate())
                if self.step % c.log.every == 0 or last_step or metrics:
                    metrics.update(self._interval_metrics(interval, stats))
                    last_loss = metrics.get("loss", last_loss)
                    if st.is_main:
                        metrics.update(self.monitor.observe(self.step, metrics))  # alerts, biases, load log
                        self._log(metrics)
                        history.append({"step": self.step, **metrics})
                    interval = {"sums": np.zeros(6), "steps": 0, "time": 0.0}
                stop = self._stop_requested()
                checkpoint_due = checkpoint_due or self.step % c.checkpoint.every == 0 or last_step or stop
                if (
                    checkpoint_due and stats["finite"]
                ):  # never right after a skipped step: see _last_good_checkpoint
                    self.save_checkpoint()
                    checkpoint_due = False
                if stop:
                    if st.is_main:
                        saved = (
                            "saved" if not checkpoint_due else "kept (the last step was skipped, not saved)"
                        )
                        print(
                            f"moe-lab train: {self._stop_signal or 'SIGTERM'} at step {self.step}: checkpoint "
                            f"{self.last_checkpoint} {saved}; continue with --resume",
                            flush=True,
                        )
                    return self._result(last_loss, history, stopped_by=self._stop_signal or "SIGTERM")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        export_dir = None
        if c.checkpoint.export and st.is_main and self.last_checkpoint is not None:
            tokenizer = self.data_dir / "tokenizer" if self.data_dir else None
            export_dir = ckpt_io.export_checkpoint(self.last_checkpoint, self.out_dir / EXPORT_DIR, tokenizer)
        par.barrier(st)
        return self._result(last_loss, history, export_dir=export_dir)

    def _stop_requested(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_signal else 0.0])
        if self.state.distributed:
            par.all_reduce_(flag, self.state, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _interval_metrics(self, interval: dict, stats: dict[str, float]) -> dict[str, float]:
        c, st = self.config, self.state
        sums, n_ok = interval["sums"], interval["sums"][5]
        out: dict[str, float] = {}
        if n_ok:
            for i, key in enumerate(("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")):
                out[key] = float(sums[i] / n_ok)
            if not self.moe_layer_ids:
                del out["aux_loss"], out["z_loss"]
        out["lr"] = stats["lr"]
        tokens = interval["steps"] * c.batch_size * c.data.seq_len
        seconds = max(interval["time"], 1e-9)
        out["tokens_per_s"] = tokens / seconds
        out["step_time_s"] = seconds / max(interval["steps"], 1)
        out["tokens"] = float(self.tokens)
        out["flops_per_token"] = self.flops_per_token
        achieved = self.flops_per_token * tokens / seconds / st.world_size  # per device
        out["tflops_per_device"] = achieved / 1e12
        if self.peak_flops:
            out["mfu"] = achieved / self.peak_flops
        out["skipped_steps"] = float(self.skipped_steps)
        out.update(par.comm_metrics(self.model, st, interval["steps"], interval["time"]))
        if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":  # under torchrun's elastic agent
            out["elastic/restarts"] = float(restart_count())
        if self.moe_layer_ids:
            if st.distributed:
                par.all_reduce_(self.routing.sums_LX, st)
            out.update(self.routing.metrics(self.moe_layer_ids, c.log.per_expert))
            self.routing.reset()
        return out

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
