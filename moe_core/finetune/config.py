"""The fine-tuning configuration: one typed object, checked when built, saved as ``finetune_config.json`` with
every output.

    config = FinetuneConfig.build({
        "model": {"path": "runs/switch-tiny/final"},
        "data": {"source": "data/alpaca.jsonl"},
        "method": "lora",
        "lora": {"experts": "esft", "esft_share": 0.3},
        "steps": 50,
    })
    config = config.with_overrides(["lora.r=16", "objective=dpo"])   # the CLI's --set

Sections: ``model`` (where the base model and tokenizer come from), ``data``, ``lora`` (LoRA targets and expert
subsets), ``freeze`` (router and expert freezing), ``routing`` (task-conditioned router bias), ``dpo``, ``orpo``, ``kto``,
``reward``, ``grpo`` (the objectives' own settings), ``optim``,
``log``, ``export``, ``parallel`` (experts split over processes) and ``checkpoint`` (resumable checkpoints);
top-level fields hold the method, objective, batch, steps and seed.

Methods (``method``):
- ``full``: every weight trains, except what ``freeze`` holds back (the router, chosen experts, ...).
- ``lora``: PEFT LoRA on attention (``lora.attention``) and on the experts (``lora.experts``: ``all``, a chosen
  ``list`` in ``lora.expert_ids``, or ``esft``: the experts the router sends most of the task's own tokens to,
  DeepSeek's Expert-Specialized Fine-Tuning); the base stays frozen; ``freeze.router=false`` trains the router
  as a full copy saved with the adapter (PEFT ``modules_to_save``).
- ``qlora``: shorthand for ``lora`` with ``quantize.base=nf4`` (QLoRA, Dettmers et al. 2023): the frozen base
  experts, shared experts and attention projections are held in 4 bits (the lab's own grouped NF4 / int4 codes,
  `moe_core.quantized`; ``quantize.attention=false`` keeps the attention in ``model.dtype``), quantized while the
  checkpoint streams in, and LoRA trains on top; the adapter is that of LoRA on the full-precision model.
- ``router``: task-adaptive routing by tuning only the router gates.
- ``router_bias``: only a task-conditioned router bias trains (needs ``data.task_column``).
``routing.task_bias=true`` adds the task-conditioned router bias to any method (multi-task training).

The routers' selection bias (``expert_bias`` of the aux-loss-free ``aux_free`` / ``deepseek`` routers, DeepSeek-V3
and GLM-4.5's ``e_score_correction_bias``; the base model's ``router_bias_update_rate`` is its step) moves only
while the router trains (`train_router`: ``method=router``, ``full`` unless ``freeze.router``, ``lora`` with
``freeze.router=false``); a frozen router keeps the base model's bias, as ESFT freezes the gates and transformers
never updates it. Whenever it moved it is saved with every output, so each reproduces the trained model's routing:
in the adapter beside the trained gate (our names: ``...router.expert_bias``, restored by ``moe_core.load`` and
stock PEFT alike; HF names: the gate's ``e_score_correction_bias``, refused for a router with no bias there), in
merged/ and hf/ as the model's own buffer, and in resumable checkpoints (`moe_core.finetune.selection_bias`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moe_core.configfile import ConfigFile
from moe_core.errors import MoELabError
from moe_core.train.config import FaultSection


class FinetuneError(MoELabError):
    """A fine-tuning config or setup that cannot work: the message names the field and what to do."""


class FinetuneDivergedError(FinetuneError):
    """Too many steps in a row with a non-finite loss or gradient, or weights that are not finite."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    # our checkpoint directory (config.json with model_type "moe_lab"), or a Hugging Face checkpoint directory or
    # hub id of an architecture moe_core.convert reads (converted exactly with moe_core.convert.from_hf; exported
    # back as that architecture)
    path: str | None = None
    tokenizer: str | None = (
        None  # a tokenizer directory or prepared-data directory; default: the model's directory
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the frozen base stays memory-mapped from its safetensors files instead of copied into memory (moe_core.mapped:
    # page cache the kernel can drop, so a base larger than RAM fine-tunes when a step touches less than RAM holds).
    # None: mapped when the method keeps the base frozen (not full) and the files hold dtype, else copied with a
    # printed reason; true: mapped, or refused before any weight loads; false: copied
    mmap: bool | None = None


class DataSection(_Section):
    source: str | None = None  # a moe_core.data source: a local file/dir/glob or hf:owner/name
    hub_config: str | None = None
    split: str = "train"
    max_examples: int | None = Field(None, ge=1)
    max_length: int = Field(512, ge=8)  # tokens per sequence (prompt + completion); longer ones are truncated
    # how the data is framed: a built-in chat template (lab, chatml), a Jinja file, or "plain": no template, the
    # prompt's text and a newline, then the answer and EOS (moe_core.data.framing; for base models such as
    # OLMoE-1B-7B and Mixtral-8x7B, which ship without a template); None: the tokenizer's own template. Saved
    # with the outputs (their tokenizer and prompt_framing.json), so generate and eval frame prompts the same way
    chat_template: str | None = None  # lab, chatml, a Jinja file, or plain; None: the tokenizer's own
    task_column: str | None = None  # a column naming each example's task: multi-task training and task bias
    validate_data: bool = False  # run the moe_core.data expectation suite first (slow on big sets)


class LoraSection(_Section):
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    # attention projections that get an adapter; [] for none
    attention: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # which routed experts get an adapter: none, all, a chosen list, or ESFT (most used on the task's data)
    experts: Literal["none", "all", "list", "esft"] = "all"
    # for experts="list": the same experts in every MoE layer ([0, 3]) or per layer ({1: [0, 3], 3: [2]})
    expert_ids: list[int] | dict[int, list[int]] | None = None
    # ESFT (Wang et al. 2024, "Let the Expert Stick to His Last"): per layer, take experts by descending share of
    # the task's routed tokens until their cumulative share reaches esft_share (the paper's threshold p)
    esft_share: float = Field(0.2, gt=0, le=1)
    esft_score: Literal["token", "gate"] = (
        "token"  # ESFT-Token (share of routed slots) or ESFT-Gate (mean score)
    )
    esft_max_experts: int | None = Field(None, ge=1)  # cap per layer
    esft_examples: int = Field(64, ge=1)  # examples of the training set the routing profile is taken on
    shared_expert: bool = False  # also an adapter on the always-on shared expert (Qwen2-MoE / DeepSeekMoE)
    dense_ffn: bool = False  # also adapters on dense FFN layers (non-MoE layers)
    # a LoRA fine-tune's output whose adapter this run starts from and trains on (SFT, then DPO or KTO against
    # that adapter, frozen, as the reference); its base, the adapter's shape (this section, freeze, quantize)
    # and ESFT's experts are the recorded ones (moe_core.finetune.as_trained.continued). model.path naming such
    # an output that holds its adapter alone sets it
    init_from: str | None = None


class FreezeSection(_Section):
    # the router gates; None: frozen for lora, trained for full; router/router_bias methods ignore it
    router: bool | None = None
    # routed experts that must not change: the same in every MoE layer ([1, 2]) or per layer ({1: [0]})
    experts: list[int] | dict[int, list[int]] = Field(default_factory=list)
    shared_expert: bool = False  # freeze the shared expert (full fine-tuning)
    embeddings: bool = False  # freeze the input embeddings and LM head (full fine-tuning)


class RoutingSection(_Section):
    task_bias: bool = (
        False  # a learned per-task, per-layer bias on the router logits (needs data.task_column)
    )


class DpoSection(_Section):
    beta: float = Field(0.1, gt=0)
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"


class RewardSection(_Section):
    # objective=reward (TRL RewardTrainer): a scalar head on the backbone, trained on prompt/chosen/rejected pairs
    # with the pairwise loss -log sigmoid(r_chosen - r_rejected). center_coefficient: + c * mean((r_c + r_r)^2),
    # keeping rewards near zero (Eisenstein et al. 2023); None: off
    center_coefficient: float | None = Field(None, ge=0)


class OrpoSection(_Section):
    # objective=orpo (Hong et al. 2024; TRL's trl.experimental.orpo, experimental upstream): SFT loss on the
    # chosen answer plus beta (the paper's lambda) times the odds-ratio term; no reference model
    beta: float = Field(0.1, gt=0)


class KtoSection(_Section):
    # objective=kto (Ethayarajh et al. 2024; TRL KTOTrainer): unpaired prompt/completion/label data
    beta: float = Field(0.1, gt=0)
    desirable_weight: float = Field(1.0, gt=0)  # weight of label=true examples' losses
    undesirable_weight: float = Field(1.0, gt=0)  # weight of label=false examples' losses


class GrpoSection(_Section):
    # objective=grpo (Group Relative Policy Optimization, Shao et al. 2024, DeepSeekMath §4.1; TRL GRPOTrainer):
    # prompt data; each prompt sampled num_generations times with the lab's decode path
    # (`moe_core.inference.generate.batch_generate`), each completion scored by the rewards, and its advantage its
    # reward against its group's (`moe_core.finetune.grpo`)
    # reward functions as import paths "package.module:function" (TRL's signature: prompts, completions, **columns ->
    # one float per completion); the module is imported, so name only code you trust
    rewards: list[str] = Field(default_factory=list)
    # a reward model (objective=reward's output: its merged/ or the fine-tuning directory), scoring each
    # prompt + completion; its reward adds to the functions'
    reward_model: str | None = None
    num_generations: int = Field(4, ge=2)  # completions per prompt (the group)
    max_completion_length: int = Field(32, ge=1)  # new tokens per completion
    temperature: float = Field(1.0, gt=0)  # sampling, and the log-probabilities the loss takes
    top_k: int = Field(0, ge=0)  # 0: no top-k filter while sampling
    beta: float = Field(
        0.0, ge=0
    )  # KL to the reference policy; above 0 needs method=lora (the base is the reference)
    epsilon: float = Field(0.2, gt=0)  # the ratio's clip range
    # token: a ratio per token (GRPO); sequence: one ratio per sequence, the length-normalized sequence likelihood
    # ratio of GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), TRL's importance_sampling_level
    importance_sampling: Literal["token", "sequence"] = "token"
    # how token losses are aggregated (TRL's loss_type); None: grpo with sequence ratios (GSPO's setup), else dapo
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] | None = None
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantages divided by the group's reward std
    # R3 (`moe_core.routing.RoutingReplay`): the training pass routes each token to the experts it was routed to
    # while the rollout was sampled; the routing decisions replay changed are logged either way
    routing_replay: bool = True
    probe_prompts: int = Field(8, ge=1)  # the fixed prompts the per-step routing shift is measured on

    @field_validator("rewards", mode="before")
    @classmethod
    def _one_reward(cls, value):  # --set grpo.rewards=pkg.module:function
        return [value] if isinstance(value, str) else value

    @field_validator("rewards")
    @classmethod
    def _import_paths(cls, value):
        for path in value:
            module, _, name = path.partition(":")
            if not module or not name or not all(p.isidentifier() for p in module.split(".")):
                raise ValueError(
                    f"grpo.rewards: {path!r} is not an import path 'package.module:function' (e.g. "
                    "'moe_core.finetune.rewards:sum_of_two')"
                )
        return value

    @property
    def resolved_loss_type(self) -> str:
        if self.loss_type is not None:
            return self.loss_type
        return "grpo" if self.importance_sampling == "sequence" else "dapo"


class OptimSection(_Section):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: float | None = Field(1.0, gt=0)
    # LoRA on stacked experts: an expert that got no token in an optimizer step. hold: not stepped, its factors,
    # moments and step count stay, moments kept only from an expert's first token on (lazy Adam; transformers 4
    # + PEFT on Mixtral or Qwen2-MoE, whose experts without tokens are not run; `moe_core.train.optim.ExpertAdamW`);
    # step: the stack steps as one tensor (a zero gradient row still moves by momentum and weight decay; moments
    # for every expert: transformers 4's OLMoE, which runs every expert)
    idle_experts: Literal["hold", "step"] = "hold"


class LogSection(_Section):
    every: int = Field(1, ge=1)
    routing: bool = True  # per-layer routing statistics (expert load, entropy) in the metrics
    per_expert: bool = False  # per-expert token fractions too
    progress: Literal["auto", "bar", "lines", "off"] = "auto"  # auto: a bar on a terminal, lines otherwise

    @field_validator("progress", mode="before")
    @classmethod
    def _off(cls, value):
        return "off" if value is False else value  # `progress: off` in a YAML file


class ExportSection(_Section):
    adapters: bool = True  # <out>/adapter: the PEFT adapter alone (lora)
    # <out>/merged: our format with the adapter folded in; None: unless a LoRA fine-tune's base model is large
    # (`resolve_size_defaults`: above LARGE_MODEL_PARAMS only the adapter is written by default)
    merged: bool | None = None  # None: written, except for LoRA on a base above 1 B parameters
    # <out>/hf: the Hugging Face architecture; None: when the model came from one and is not large
    hf: bool | None = None  # None: for a Hugging Face base up to 1 B parameters
    # merged/ and hf/ are written in safetensors shards of at most this many MB (10**6 bytes), one tensor at a
    # time from the model's own memory: a shard is never copied whole
    max_shard_mb: int = Field(5000, ge=1)  # the largest safetensors shard of merged/ and hf/


# 2: quantize.attention exists, on by default under QLoRA (a version-1 config reads as false: what it trained)
# 3: quantize.shared_experts exists; an adapted shared expert is in 4 bits too (version 2 held it in full)
# 4: optim.idle_experts exists, "hold" by default (an older config reads as "step": what it trained)
CONFIG_VERSION = 4


class QuantizeSection(_Section):
    # the frozen base experts in few bits while LoRA trains (QLoRA); None: in model.dtype. nf4: NormalFloat4
    # levels (QLoRA's choice for normally distributed weights); int4: evenly spaced; int8: one scale per row
    base: Literal["nf4", "int4", "int8"] | None = None
    group_size: int = Field(
        64, ge=2, multiple_of=2
    )  # 4-bit codes: inputs sharing one absmax scale (QLoRA: 64)
    # the attention projections (q/k/v/o; MLA's) in the same bits too, LoRA on them unchanged (its adapter keys are
    # those of LoRA on the full-precision model). None: on whenever quantize.base is set, as bitsandbytes' QLoRA
    # holds every linear layer in 4 bits (full-size Qwen1.5-MoE-A2.7B: peak 11.7 GiB, not 12.2, for a step 1.07x);
    # false: the attention in model.dtype (configs saved before version 2 read as false)
    attention: bool | None = None
    # the shared experts' projections (Qwen2-MoE's, DeepSeekMoE's) in the same bits, with or without LoRA on them
    # (lora.shared_expert). None: on whenever quantize.base is set; false: in model.dtype (a config saved before
    # version 3 with lora.shared_expert reads as false: it held an adapted shared expert in full precision)
    shared_experts: bool | None = None


class ParallelSection(_Section):
    # Under torchrun (`moe-lab finetune --nproc N`, `moe_core.finetune.parallel`): the routed experts, and their
    # LoRA factors, split over groups of ep_size ranks (ep_size must divide N and the expert count); everything
    # else replicated on every rank, its gradients averaged over all N (each rank a data-parallel replica of
    # batch_size sequences). 1: every rank holds the whole model (data parallel only)
    ep_size: int = Field(1, ge=1)


class CheckpointSection(_Section):
    # every this many optimizer steps, a resumable checkpoint in OUT/checkpoints (per rank: trainable weights,
    # optimizer, scheduler, RNG); `finetune --resume` continues from the newest complete one. None: none
    every: int | None = Field(None, ge=1)
    keep: int = Field(2, ge=1)  # the newest checkpoints kept; older ones are removed


class FinetuneConfig(_Section, ConfigFile):
    error_cls: ClassVar[type[MoELabError]] = FinetuneError
    config_name: ClassVar[str] = "fine-tuning config"
    command: ClassVar[str] = "finetune"

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    method: Literal["full", "lora", "router", "router_bias"] = "lora"  # "qlora": lora + quantize.base=nf4
    # sft: instruction data; dpo, orpo, reward: preference data (prompt/chosen/rejected); kto: prompt/completion/
    # label data; grpo: prompts (and columns its reward functions read). reward trains a reward model
    # (moe_core.reward_model), the others the policy
    objective: Literal["sft", "dpo", "orpo", "kto", "reward", "grpo"] = "sft"
    lora: LoraSection = Field(default_factory=LoraSection)
    freeze: FreezeSection = Field(default_factory=FreezeSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    dpo: DpoSection = Field(default_factory=DpoSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    orpo: OrpoSection = Field(default_factory=OrpoSection)
    kto: KtoSection = Field(default_factory=KtoSection)
    grpo: GrpoSection = Field(default_factory=GrpoSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    log: LogSection = Field(default_factory=LogSection)
    export: ExportSection = Field(default_factory=ExportSection)
    quantize: QuantizeSection = Field(default_factory=QuantizeSection)
    faults: FaultSection = Field(default_factory=FaultSection)  # the same rule as pretraining
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)

    steps: int = Field(20, ge=1)
    batch_size: int = Field(
        4, ge=1
    )  # sequences (SFT, KTO), preference pairs (DPO, ORPO, reward) or completions (GRPO) per micro-step
    grad_accum: int = Field(1, ge=1)
    completion_only: bool = True  # SFT loss on the answer tokens only (the prompt is context)
    # recompute activations in backward; None: on for a large base model or large activations, off otherwise
    # (`resolve_size_defaults`; TRL turns it on always), and off with the task router bias, which it breaks
    gradient_checkpointing: bool | None = None  # None: on above 1 B parameters or 4 GiB of activations
    # each decoder layer through torch.compile (`moe_core.model.compile_layers`): fewer kernel launches where the
    # host bounds the step (a GPU); the first steps compile (tens of seconds)
    compile: bool = False
    seed: int = 0
    version: int = CONFIG_VERSION

    @field_validator("lora", "freeze", mode="before")
    @classmethod
    def _int_layer_keys(cls, value):  # YAML/JSON give per-layer dicts with string keys
        if isinstance(value, dict):
            for key in ("expert_ids", "experts"):
                ids = value.get(key)
                if isinstance(ids, dict):
                    value = {**value, key: {int(k): v for k, v in ids.items()}}
        return value

    @model_validator(mode="before")
    @classmethod
    def _an_older_config_reads_as_it_trained(cls, data):
        """A field added since a config was saved takes the value its run trained with, so that the run reloads
        on the base it trained on and resumes as it trained: before version 2 (no ``quantize.attention``) QLoRA
        held the attention in the model's dtype; before version 3 (no ``quantize.shared_experts``) it held an
        adapted shared expert (``lora.shared_expert``) so too; before version 4 (no ``optim.idle_experts``) the
        stacked experts' factors stepped as one tensor. A config without a version is a new one."""
        if not isinstance(data, dict):
            return data
        version = data.get("version", CONFIG_VERSION)
        trained = {}
        if version < 2:
            trained["attention"] = False
        if version < 3 and (data.get("lora") or {}).get("shared_expert"):
            trained["shared_experts"] = False
        if trained:
            data = {**data, "quantize": {**trained, **(data.get("quantize") or {})}}
        if version < 4:
            data = {**data, "optim": {"idle_experts": "step", **(data.get("optim") or {})}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _qlora_is_lora_on_a_quantized_base(cls, data):
        """``method=qlora`` is LoRA with ``quantize.base`` given, or NF4 where it is not. Unset and null read
        alike: ``--set`` applies its assignments to a whole dumped config (`ConfigFile.with_overrides`), where
        every field is present and an unset ``quantize.base`` is null."""
        if isinstance(data, dict) and data.get("method") == "qlora":
            quantize = dict(data.get("quantize") or {})
            if quantize.get("base") is None:
                quantize["base"] = "nf4"
            data = {**data, "method": "lora", "quantize": quantize}
        return data

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        if self.quantize.base is not None and self.method != "lora":
            raise ValueError(
                f"quantize.base={self.quantize.base} holds the frozen base in few bits under LoRA (QLoRA); "
                f"method={self.method} trains base weights: use method=lora (or qlora), or unset quantize.base"
            )
        if self.quantize.attention and self.quantize.base is None:
            raise ValueError(
                "quantize.attention=true holds the attention projections in quantize.base's bits; set "
                "quantize.base (nf4, int4 or int8; method=qlora sets nf4) or unset quantize.attention (it "
                "follows quantize.base)"
            )
        if self.quantize.shared_experts and self.quantize.base is None:
            raise ValueError(
                "quantize.shared_experts=true holds the shared experts in quantize.base's bits; set "
                "quantize.base (nf4, int4 or int8; method=qlora sets nf4) or unset quantize.shared_experts (it "
                "follows quantize.base)"
            )
        if self.quantize.base is not None and (self.export.merged or self.export.hf):
            raise ValueError(
                "export.merged / export.hf with quantize.base: an adapter trained on a quantized base is merged "
                "into the full-precision model it came from, not into the quantized copy; leave them unset and "
                "apply OUT/adapter to the base afterwards (moe_core.load('OUT/adapter') does, on a machine "
                "that holds the full-precision model)"
            )
        if self.parallel.ep_size > 1:
            _check_expert_parallel(self)
        if self.model.mmap and self.method == "full":
            raise ValueError(
                "model.mmap=true keeps the frozen base memory-mapped from its files; method=full trains every "
                "base weight (a copy in memory): set model.mmap=false (or leave it unset), or use method=lora"
            )
        if self.model.mmap and self.quantize.base is not None:
            raise ValueError(
                f"model.mmap=true with quantize.base={self.quantize.base}: the QLoRA loader quantizes the experts "
                "while they stream in, which is not a mapping; choose one (QLoRA when the 16-bit experts do not "
                "fit in memory, see the README's fine-tuning section)"
            )
        if self.method == "lora" and self.lora.experts == "list" and not self.lora.expert_ids:
            raise ValueError("lora.experts='list' needs lora.expert_ids, e.g. [0, 3] or {1: [0, 3]}")
        if self.lora.experts != "list" and self.lora.expert_ids:
            raise ValueError("lora.expert_ids is set but lora.experts is not 'list'; set lora.experts: list")
        needs_tasks = self.method == "router_bias" or self.routing.task_bias
        if needs_tasks and not self.data.task_column:
            raise ValueError(
                "a task-conditioned router bias needs data.task_column (the column naming each "
                "example's task)"
            )
        if self.gradient_checkpointing and needs_tasks:
            raise ValueError(
                "gradient_checkpointing does not work with the task-conditioned router bias (the "
                "recomputed forward has no task ids); set gradient_checkpointing=false, or leave it unset (auto "
                "keeps it off with the task bias)"
            )
        if self.objective != "sft" and needs_tasks:
            raise ValueError(
                f"the task-conditioned router bias is not supported with objective={self.objective} yet; "
                "use objective=sft or routing.task_bias=false"
            )
        if self.objective == "grpo":
            _check_grpo(self)
        if self.compile and (self.objective == "grpo" or self.parallel.ep_size > 1):
            other = (
                "objective=grpo (it also decodes with the compiled layers: a graph per cache length)"
                if self.objective == "grpo"
                else f"parallel.ep_size={self.parallel.ep_size} (tokens cross ranks inside the compiled layers)"
            )
            raise ValueError(f"compile=true is not supported with {other} yet; set compile=false")
        if self.objective in ("orpo", "kto", "reward", "grpo") and self.parallel.ep_size > 1:
            raise ValueError(
                f"objective={self.objective} with parallel.ep_size={self.parallel.ep_size}: experts split over "
                "processes are supported for sft and dpo only; use parallel.ep_size=1"
            )
        if self.objective == "reward" and (self.export.hf or self.quantize.base is not None):
            raise ValueError(
                "objective=reward writes a reward model (moe_core.reward_model: the backbone and a score head), "
                "which has no Hugging Face MoE architecture and is not trained on a quantized base; leave "
                "export.hf and quantize.base unset"
            )
        if self.objective == "kto" and self.batch_size < 2:
            raise ValueError(
                "objective=kto estimates its KL reference point from mismatched pairs within a batch; set "
                "batch_size to 2 or more"
            )
        if (
            self.method == "lora"
            and not self.lora.attention
            and self.lora.experts == "none"
            and not self.lora.shared_expert
            and not self.lora.dense_ffn
        ):
            raise ValueError("lora: no target at all (attention=[], experts='none'); pick at least one")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def expert_parallel(self) -> bool:
        return self.parallel.ep_size > 1

    @property
    def train_router(self) -> bool:
        if self.method == "router":
            return True
        if self.method == "router_bias":
            return False
        return self.freeze.router is False if self.method == "lora" else self.freeze.router is not True

    @property
    def uses_task_bias(self) -> bool:
        return self.method == "router_bias" or self.routing.task_bias


def _check_grpo(config: FinetuneConfig) -> None:
    """What objective=grpo needs, refused before anything loads."""
    grpo = config.grpo
    if not grpo.rewards and grpo.reward_model is None:
        raise ValueError(
            "objective=grpo needs a reward: grpo.rewards (import paths 'package.module:function', e.g. "
            "'moe_core.finetune.rewards:sum_of_two') and/or grpo.reward_model (a reward model directory)"
        )
    completions = config.batch_size * config.grad_accum
    if completions % grpo.num_generations:
        raise ValueError(
            f"objective=grpo samples batch_size x grad_accum = {completions} completions per optimizer step in "
            f"groups of grpo.num_generations={grpo.num_generations}: make the product a multiple of it"
        )
    if grpo.max_completion_length >= config.data.max_length:
        raise ValueError(
            f"grpo.max_completion_length={grpo.max_completion_length} leaves no room for the prompt in "
            f"data.max_length={config.data.max_length}; raise data.max_length or lower grpo.max_completion_length"
        )
    if grpo.beta > 0 and config.method != "lora":
        raise ValueError(
            f"grpo.beta={grpo.beta} with method={config.method}: the KL reference is the base model under the "
            "adapter (method=lora); TRL would reload a full reference from the model's path. Use method=lora, or "
            "grpo.beta=0"
        )
    if config.checkpoint.every is not None:
        raise ValueError(
            "checkpoint.every with objective=grpo: resumable GRPO runs are not supported yet (the rollout buffer "
            "and sampling state are not checkpointed); leave checkpoint.every unset"
        )


def _check_expert_parallel(config: FinetuneConfig) -> None:
    """What does not compose with experts sharded over ranks (``parallel.ep_size`` > 1), refused before anything
    loads."""
    ep = config.parallel.ep_size
    if config.method != "lora":
        raise ValueError(
            f"parallel.ep_size={ep} shards the frozen experts and their LoRA factors over ranks; method="
            f"{config.method} trains the expert weights themselves, which a fine-tune does not shard: use "
            "method=lora, or parallel.ep_size=1 (every rank holds the whole model)"
        )
    if config.quantize.base is not None:
        raise ValueError(
            f"parallel.ep_size={ep} with quantize.base={config.quantize.base} (QLoRA): the 4-bit experts "
            "(moe_core.quantized.QuantizedExperts) are not sliced over ranks; use parallel.ep_size=1 or quantize.base "
            "unset"
        )
    if config.export.merged or config.export.hf:
        raise ValueError(
            f"export.merged / export.hf with parallel.ep_size={ep}: no rank holds every expert, so none can "
            "write the merged model; leave them unset (the adapter is written, gathered to one file) and merge "
            "afterwards on one machine (moe_core.load('OUT/adapter'))"
        )
    if config.train_router:
        raise ValueError(
            f"freeze.router=false with parallel.ep_size={ep}: a trained router under expert parallelism is not "
            "supported yet; keep the router frozen, or use parallel.ep_size=1"
        )
