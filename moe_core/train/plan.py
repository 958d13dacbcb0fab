"""The planner (`moe-lab plan`): which parallel layouts fit a model on N GPUs, what each rank holds, what a step
communicates, and which layout to pick; also the check `moe-lab train` runs before it allocates anything.

    plan = make_plan(TrainConfig.from_preset("mixtral-small"), gpus=8, gpu_memory_gb=80)
    print(plan_table(plan)); plan.as_json()

A layout is (``ep_size``, ``dp_mode`` ddp | fsdp2, activation checkpointing off | on) over ``world = gpus *
nodes`` ranks; every rank gets ``batch_size / (grad_accum * world)`` sequences per micro-step (the trainer's
split, `TrainConfig.micro_batch_size`). Per rank (the largest one: FSDP2's first shards are the widest):

- weights, gradients, AdamW state: the parameters this rank owns, fp32 (the trainer keeps fp32 masters under
  autocast), counted from the meta model laid out as `moe_core.train.build.rank_parameter_bytes` lays it out
  (experts / ep_size; dense whole under DDP, ``Shard(0)`` rows under FSDP2);
- activations: what autograd saves in one forward of one micro-batch (`activation_parts`, per op below);
- peak: a walk through one step (`step_peak`): the forward's end, each layer's backward (activations of the
  layers below still held, gradients of the layers above already written), the optimizer step.

Activation model (bytes one forward saves for backward, per op of `moe_core.model`; fp32 exact, tested against
a `saved_tensors_hooks` probe in tests/test_plan.py). Legend: B = micro-batch, S = sequence length, T = B*S,
D = hidden, H = heads, G = kv heads, Hd = head dim, E = experts, K = experts per token, A = routed slots kept
(T*K dropless; at most E * ceil(cf*T*K/E) with a capacity factor cf), Fe = expert width, F = dense FFN width,
Fs = shared experts' total width, V = vocab, a = bytes of an activation (4 fp32; 2 under bf16/fp16 autocast for
matmul outputs: an approximation there), j = 2 for a SwiGLU FFN (gate, up, silu, product), 1 for GELU (up, gelu):

    RMSNorm over width n (input, normalized, 1/rms)       (2 n + 1) T * 4
    attention: q/k/v input, q, k, v (expanded to H), out   T D a + 4 T H Hd a + T H * 4 (log-sum-exp)
      qk-norm (OLMoE)                                      (2 H Hd + 1) T * 4 + (2 G Hd + 1) T * 4
      qk-norm per head (Qwen3)                             (2 H Hd + H) T * 4 + (2 G Hd + G) T * 4
      attention sinks (gpt-oss, eager): instead of T H 4   B H S (S+1) 4 + T H 8 + S S (softmax, argmax, mask)
    router (fp32): gate input, probs, top-k ids, mask      T D 4 [+ T D 4 jitter noise] + T E 4 + T K 8 + T K
      renormalized top-k weights                           T K 4 + T 4 (softmax over the top-k logits: T K 4)
      load-balancing and z losses                          T 4 + (T E 4 + T 4) per layer; L_moe E 4 + 4 once
    dispatch (sorted by expert)                            2 A 8 (slot and token indices)
    experts, one process                                   A D a + 2 j A Fe a + 2 A D a + A 4 + E 4
    experts, expert-parallel (all-to-all path)             2 A 8 + R D a + 2 j R Fe a + A D a + A 4 + El 4
                                                           (R = A; El = E / ep: local experts)
      (E 4, El 4: grouped_mm's int32 offsets, the path of a trainer's fp32 weights on a CPU and of bf16 on
      Hopper; the sorted path, taken for widths grouped_mm cannot take, saves none: 4 bytes an expert high)
    shared experts (+ Qwen2 gate)                          2 j T Fs a [+ T 4 + T D a]
    dense FFN layer                                        T D a + 2 j T F a
    once: token ids, RoPE cos/sin, final norm, lm_head     T 8 + 2 T Hd 4 [no ckpt] + (2 D + 1) T 4 + T D a
    loss (log-softmax of the shifted logits, labels)       B (S-1) V 4 + B (S-1) 8 [B > 1] + 4

The attention term assumes a fused SDPA kernel (flash / memory-efficient, as on CPU and CUDA for these shapes);
the math fallback would also keep the B H S S probabilities. With activation checkpointing a decoder layer
saves only its input (T D 4) and its router's probabilities and logits for the losses outside it (2 T E 4 +
2 T 4); in backward one layer at a time is recomputed, so the step peak adds the largest layer's activations.

Communication per optimizer step and rank (ring algorithms; ``g`` = grad_accum): expert parallelism 4 A D a
(ep-1)/ep per MoE layer and micro-step (dispatch and combine, forward and backward; 6 with checkpointing, the
recompute dispatches again); DDP an all-reduce of the dense gradients, 2 (W-1)/W bytes; the expert shards'
gradients all-reduced over the W/ep data-parallel replicas; FSDP2 all-gathers the dense weights in forward and
backward of every micro-step, 2 g (W-1)/W, and reduce-scatters the gradients once, (W-1)/W.

On CPU ranks the peak adds what a training process holds beside its tensors (`CPU_PROCESS_BYTES`: Python
objects of the model and trainer, gloo's buffers, threads, code loaded on first use; measured by
`benchmarks/plan_check.py`'s near-empty launches). On CUDA that memory is the host's, not the device's.

Approximated, with the reason, where a model has them (`activation_caveats`, shown by the plan): MLA, sigmoid /
group-limited routing, biased experts and the clamped SwiGLU, sliding-window layers, partial RoPE.

Not modelled: the allocator's fragmentation and caching (CUDA's caching allocator rounds up), CUDA context and
NCCL buffers (about 0.5-1 GiB a GPU: `headroom_gb`), DeepSpeed, torch.compile, imbalance of routing under
expert parallelism (R is taken as A, the balanced expectation). Predicted against the real
trainer's peaks: benchmarks/README.md ("Planner").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from moe_core.train import parallel as par
from moe_core.train.build import build_meta_model
from moe_core.train.config import TrainConfig

GIB = 1024**3
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# A CPU training process's memory beside its tensors: 24-35 MiB per rank in benchmarks/plan_check.py's launches
# of a model of a few hundred KiB (torch 2.13, gloo, 1-4 ranks; benchmarks/README.md "Planner")
CPU_PROCESS_BYTES = 32 * 2**20


class PlanError(par.ParallelError):
    """A layout the planner refuses (does not fit, or does not divide): the message carries its numbers."""


# ------------------------------------------------------------------------------------------------ parameters
@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the whole model: its bytes (fp32), dim-0 rows, whether it is an expert stack's, and the
    decoder layer it belongs to (None: embeddings, final norm, lm_head)."""

    name: str
    nbytes: int
    rows: int
    expert: bool
    layer: int | None


def model_params(model_config) -> list[ParamInfo]:
    """The parameters of the meta-built model (tied ones once), as the trainer builds it."""
    out = []
    for name, p in build_meta_model(model_config).named_parameters():
        parts = name.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        out.append(
            ParamInfo(name, p.numel() * 4, p.shape[0] if p.dim() else 1, ".mlp.experts." in name, layer)
        )
    return out


def rank_layer_bytes(
    params: list[ParamInfo], world: int, ep_size: int, dp_mode: str, rank: int = 0
) -> dict[int | None, int]:
    """Bytes of parameters rank ``rank`` owns, per decoder layer (None: the rest), under a layout: expert stacks
    split over ep_size, dense parameters whole (DDP) or their ``Shard(0)`` rows (FSDP2, `par.shard_rows`)."""
    out: dict[int | None, int] = {}
    for p in params:
        if p.expert:
            size = p.nbytes // ep_size
        elif dp_mode == "fsdp2" and world > 1:
            start, stop = par.shard_rows(p.rows, world, rank)
            size = p.nbytes // p.rows * (stop - start)
        else:
            size = p.nbytes
        out[p.layer] = out.get(p.layer, 0) + size
    return out


# ------------------------------------------------------------------------------------------------ activations
def routed_slots(model_config, tokens: int) -> int:
    """A: the (token, expert) slots kept in one MoE layer for ``tokens`` tokens (an upper bound with capacity)."""
    c = model_config
    slots = tokens * c.num_experts_per_tok
    if c.capacity_factor is not None:
        capacity = math.ceil(c.capacity_factor * slots / c.num_experts)
        slots = min(slots, capacity * c.num_experts)
    return slots


def layer_activation_bytes(
    model_config, micro_batch: int, seq_len: int, layer: int, precision: str = "fp32", ep_size: int = 1
) -> dict[str, int]:
    """What decoder layer ``layer`` saves for backward in one forward (the module docstring's formulas)."""
    c = model_config
    a = ACT_BYTES[precision]
    T, D, H, G, Hd = (
        micro_batch * seq_len,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    j = 2 if c.ffn_activation == "swiglu" else 1
    norm = lambda n: (2 * n + 1) * T * 4  # noqa: E731  (input, normalized, 1/rms)
    parts = {"norms": 2 * norm(D)}
    attention = T * D * a + 4 * T * H * Hd * a + T * H * 4
    if c.qk_norm and getattr(c, "qk_norm_per_head", False):  # Qwen3: a 1/rms per head and token
        attention += (2 * H * Hd + H) * T * 4 + (2 * G * Hd + G) * T * 4
    elif c.qk_norm:
        attention += norm(H * Hd) + norm(G * Hd)
    if getattr(c, "attention_sinks", False):
        # gpt-oss's sinks are computed eagerly (`moe_core.model.attention_with_sinks`): instead of SDPA's
        # log-sum-exp, the softmax over [B, H, S, S + 1] scores with the sink column, the row maxima's indices and
        # the causal mask (bool [S, S]): quadratic in S, the term that dominates at long context
        B = micro_batch
        attention += B * H * seq_len * (seq_len + 1) * 4 + T * H * 8 + seq_len * seq_len - T * H * 4
    parts["attention"] = attention
    if not c.is_moe_layer(layer):
        parts["dense_ffn"] = T * D * a + 2 * j * T * c.intermediate_size * a
        return parts
    E, K = c.num_experts, c.num_experts_per_tok
    router = T * D * 4 + T * E * 4 + T * K * 8 + T * K
    if c.router_jitter > 0:
        router += T * D * 4
    if c.router_topk_order == "topk_then_softmax":  # (gpt-oss) softmax over the k logits: its output only
        router += T * K * 4
    elif c.norm_topk_prob:
        router += T * K * 4 + T * 4
    router += T * 4 + T * E * 4 + T * 4  # load balancing (P_e), z-loss (logits, log-partition)
    parts["router"] = router
    A = routed_slots(c, T)
    Fe = c.expert_intermediate_size
    offsets = E // ep_size * 4  # grouped_mm's [E] int32 offsets (the local experts' under expert parallelism)
    if ep_size == 1:
        parts["dispatch"] = 2 * A * 8
        parts["experts"] = A * D * a + 2 * j * A * Fe * a + 2 * A * D * a + A * 4 + offsets
    else:  # the all-to-all path; R (slots received) taken as A
        parts["dispatch"] = 2 * A * 8 + 2 * A * 8
        parts["experts"] = A * D * a + 2 * j * A * Fe * a + A * D * a + A * 4 + offsets
    if c.num_shared_experts > 0:
        Fs = c.num_shared_experts * c.shared_expert_intermediate_size
        shared = 2 * j * T * Fs * a
        if c.shared_expert_gate:
            shared += T * 4 + T * D * a
        parts["shared_experts"] = shared
    return parts


def activation_caveats(model_config) -> list[str]:
    """What the per-op count above does not model exactly for this config, each with its reason: the plan's
    activations are then an approximation (held within 30% at the tiny presets by tests/test_arch_parallel.py's
    probe; the probe of tests/test_plan.py holds the rest exact)."""
    c = model_config
    out = []
    if getattr(c, "attention_type", "mha") == "mla":
        out.append(
            "multi-head latent attention: counted as attention of H heads of head_dim; its low-rank q and kv "
            "projections, their norms and the expanded keys are not, and whether SDPA takes a fused kernel with "
            "v_head_dim != qk head dim (else it keeps the B H S S probabilities) depends on the device"
        )
    if getattr(c, "router_score", "softmax") == "sigmoid" or getattr(c, "router_groups", 1) > 1:
        out.append(
            "sigmoid / group-limited routing (DeepSeek-V3, GLM-4.5): counted as a softmax top-k router"
        )
    if getattr(c, "router_bias", False) or getattr(c, "expert_bias", False) or c.swiglu_limit is not None:
        out.append("biased router and experts, clamped SwiGLU (gpt-oss): counted as unbiased SwiGLU experts")
    if getattr(c, "attention_window", None) is not None:
        out.append("sliding-window layers: counted as full causal layers (their mask path is not counted)")
    if c.rotary_dim < c.head_dim:
        out.append("partial RoPE (GLM-4.5): counted as RoPE over the whole head")
    return out


def model_activation_bytes(
    model_config, micro_batch: int, seq_len: int, precision: str = "fp32", checkpointing: bool = False
) -> dict[str, int]:
    """What one forward saves outside the decoder layers: token ids, RoPE tables, final norm, lm_head input,
    the loss's log-softmax and labels, the load-balancing fractions."""
    c = model_config
    a = ACT_BYTES[precision]
    B, S = micro_batch, seq_len
    T = B * S
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    return {
        # (checkpointed layers keep the RoPE tables as inputs, not as saved tensors)
        "embedding": T * 8 + (0 if checkpointing else 2 * T * c.head_dim * 4),
        "final_norm_head": (2 * c.hidden_size + 1) * T * 4 + T * c.hidden_size * a,
        # the shifted labels are a copy unless B = 1 (then a view of the token ids)
        "loss": B * (S - 1) * c.vocab_size * 4 + (B * (S - 1) * 8 if B > 1 else 0) + 4,
        "balance": (moe_layers * c.num_experts * 4 + 4) if moe_layers else 0,
    }


def checkpointed_layer_bytes(model_config, micro_batch: int, seq_len: int, layer: int) -> int:
    """What a checkpointed decoder layer keeps: its input, and its router's probabilities and logits (the
    router losses read them outside the layer)."""
    c = model_config
    T = micro_batch * seq_len
    kept = T * c.hidden_size * 4
    if c.is_moe_layer(layer):
        kept += 2 * T * c.num_experts * 4 + 2 * T * 4
    return kept


def activation_parts(
    model_config,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool = False,
    precision: str = "fp32",
    ep_size: int = 1,
) -> dict[str, int]:
    """Bytes one forward of a ``micro_batch`` x ``seq_len`` micro-batch saves for backward, by op kind (the
    module docstring's model). With ``checkpointing``: ``checkpointed_layers`` replaces the per-op layer terms
    (the recompute's transient is `step_peak`'s)."""
    out = dict(model_activation_bytes(model_config, micro_batch, seq_len, precision, checkpointing))
    for layer in range(model_config.num_hidden_layers):
        if checkpointing:
            kept = checkpointed_layer_bytes(model_config, micro_batch, seq_len, layer)
            out["checkpointed_layers"] = out.get("checkpointed_layers", 0) + kept
            continue
        for kind, size in layer_activation_bytes(
            model_config, micro_batch, seq_len, layer, precision, ep_size
        ).items():
            out[kind] = out.get(kind, 0) + size
    return out


# ------------------------------------------------------------------------------------------------ layouts
@dataclass
class Layout:
    """One candidate: its shape, per-rank bytes, communication per step, and whether it fits."""

    ep_size: int
    dp_mode: str
    activation_checkpointing: bool
    world: int
    micro_batch: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    all_to_all_buffers: int
    data_parallel_buffers: int
    peak: int
    comm_bytes: dict[str, int] = field(default_factory=dict)
    process: int = 0  # the process's memory beside tensors, in `peak` (CPU ranks: CPU_PROCESS_BYTES)
    fits: bool = True

    @property
    def name(self) -> str:
        ckpt = "ckpt" if self.activation_checkpointing else "no-ckpt"
        return f"ep{self.ep_size} {self.dp_mode}({self.world}) {ckpt}"

    @property
    def comm_total(self) -> int:
        return sum(self.comm_bytes.values())


def step_peak(
    layer_params: dict[int | None, int],
    layer_acts: list[int],
    model_acts: int,
    head_transient: int,
    recompute: int,
    steady: int,
    grads_extra: int,
    forward_extra: int,
) -> int:
    """The largest of: the forward's end (every activation, the logits and their gradient), each decoder
    layer's backward (layers below still saved, gradients of the layers above written, ``recompute`` of a
    checkpointed layer), the optimizer step (every gradient). ``steady``: weights + AdamW state (+ DDP's
    buckets); ``grads_extra``/``forward_extra``: FSDP2's unsharded transients and all-to-all buffers."""
    layers = len(layer_acts)
    head_grads = layer_params.get(None, 0)
    peaks = [steady + model_acts + sum(layer_acts) + head_transient + forward_extra]
    for layer in reversed(range(layers)):
        below = sum(layer_acts[: layer + 1])
        written = head_grads + sum(layer_params.get(i, 0) for i in range(layer, layers))
        peaks.append(steady + model_acts + below + recompute + written + grads_extra)
    peaks.append(steady + sum(layer_params.values()))
    return max(peaks)


def evaluate_layout(
    config: TrainConfig,
    params: list[ParamInfo],
    world: int,
    ep_size: int,
    dp_mode: str,
    checkpointing: bool,
    device: str = "cuda",
) -> Layout:
    """Per-rank bytes and communication of one layout (rank 0: under FSDP2 its shards are the widest), on
    ``device`` ranks ("cpu": the peak includes `CPU_PROCESS_BYTES`)."""
    c = config.model.build_config()
    a = ACT_BYTES[config.precision]
    micro = config.micro_batch_size(world)
    S = config.data.seq_len
    T = micro * S
    by_layer = rank_layer_bytes(params, world, ep_size, dp_mode)
    weights = sum(by_layer.values())
    L = c.num_hidden_layers
    full = [sum(layer_activation_bytes(c, micro, S, i, config.precision, ep_size).values()) for i in range(L)]
    if checkpointing:
        layer_acts = [checkpointed_layer_bytes(c, micro, S, i) for i in range(L)]
        recompute = max(full) if full else 0
    else:
        layer_acts, recompute = full, 0
    model_acts = sum(model_activation_bytes(c, micro, S, config.precision, checkpointing).values())
    # the logits stay alive through backward (the step keeps the output), and the loss's backward writes the
    # gradient of the log-softmax and of the logits beside them
    head_transient = T * c.vocab_size * a + 2 * T * c.vocab_size * 4
    if config.precision != "fp32":  # autocast keeps a 2-byte copy of each weight a matmul used for backward
        head_transient += weights // 2
    dense_whole = sum(p.nbytes for p in params if not p.expert)
    expert_shard = sum(p.nbytes for p in params if p.expert) // ep_size
    moe_layers = sum(c.is_moe_layer(i) for i in range(L))
    A = routed_slots(c, T)
    a2a = 2 * A * c.hidden_size * a if ep_size > 1 and moe_layers else 0
    dp_buffers = grads_extra = forward_extra = 0
    if world > 1 and dp_mode == "ddp":
        dp_buffers = dense_whole  # DDP's gradient buckets: a second copy of the dense gradients
    if world > 1 and dp_mode == "fsdp2":
        # the root's parameters (embeddings, final norm, lm_head) stay unsharded from forward to backward; a
        # layer is all-gathered for its forward and backward (the next one prefetched), and its unsharded
        # gradients wait for the reduce-scatter
        root = sum(p.nbytes for p in params if not p.expert and p.layer is None)
        layer_dense = max(
            (sum(p.nbytes for p in params if not p.expert and p.layer == i) for i in range(L)), default=0
        )
        forward_extra = root + 2 * layer_dense
        grads_extra = root + 3 * layer_dense
    steady = weights + 2 * weights + dp_buffers
    process = CPU_PROCESS_BYTES if device == "cpu" else 0
    peak = process + step_peak(
        by_layer, layer_acts, model_acts, head_transient, recompute, steady, grads_extra, forward_extra + a2a
    )
    g = config.grad_accum
    comm: dict[str, int] = {}
    if ep_size > 1 and moe_layers:
        passes = 6 if checkpointing else 4
        comm["all_to_all"] = int(passes * A * c.hidden_size * a * (ep_size - 1) / ep_size * moe_layers * g)
    if world > 1 and dp_mode == "ddp":
        comm["all_reduce"] = int(2 * (world - 1) / world * dense_whole)
    if world > 1 and dp_mode == "fsdp2":
        comm["all_gather"] = int(2 * g * (world - 1) / world * dense_whole)
        comm["reduce_scatter"] = int((world - 1) / world * dense_whole)
    replicas = world // ep_size
    if replicas > 1 and expert_shard:
        comm["expert_all_reduce"] = int(2 * (replicas - 1) / replicas * expert_shard)
    acts = sum(layer_acts) + model_acts
    return Layout(
        ep_size, dp_mode, checkpointing, world, micro, weights, weights, 2 * weights, acts, a2a,
        dp_buffers, peak, comm, process=process,
    )  # fmt: skip


def ep_sizes(num_experts: int, world: int) -> list[int]:
    """The expert-parallel sizes the trainer accepts: common divisors of the world and the expert count."""
    if not num_experts:
        return [1]
    return [e for e in range(1, world + 1) if world % e == 0 and num_experts % e == 0]


@dataclass
class Plan:
    model: str
    world: int
    gpus: int
    nodes: int
    gpu_memory_gb: float
    headroom_gb: float
    batch_size: int
    grad_accum: int
    seq_len: int
    precision: str
    whole_model_bytes: int
    layouts: list[Layout]
    skipped: list[str]
    # what the activation count approximates for this model, with the reasons (`activation_caveats`)
    activation_caveats: list[str] = field(default_factory=list)

    @property
    def fitting(self) -> list[Layout]:
        return [layout for layout in self.layouts if layout.fits]

    @property
    def recommended(self) -> Layout | None:
        """The fitting layout that recomputes nothing if it can, then communicates least, then holds least."""
        fitting = self.fitting
        if not fitting:
            return None
        return min(fitting, key=lambda x: (x.activation_checkpointing, x.comm_total, x.peak))

    def as_dict(self) -> dict:
        rec = self.recommended
        layouts = [{**asdict(x), "name": x.name, "comm_total": x.comm_total} for x in self.layouts]
        return {
            **{k: v for k, v in asdict(self).items() if k != "layouts"},
            "layouts": layouts,
            "recommended": rec.name if rec else None,
        }

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


def make_plan(
    config: TrainConfig,
    gpus: int,
    gpu_memory_gb: float,
    nodes: int = 1,
    headroom_gb: float = 0.0,
    ep_options: Iterable[int] | None = None,
    dp_modes: Iterable[str] = ("ddp", "fsdp2"),
    checkpointing: Iterable[bool] = (False, True),
) -> Plan:
    """Every layout of ``gpus * nodes`` ranks (``ep_options``: default every size the trainer accepts), with
    ``fits`` set against ``gpu_memory_gb - headroom_gb`` per rank. Nothing is allocated (meta model only)."""
    if gpus < 1 or nodes < 1 or gpu_memory_gb <= 0:
        raise PlanError(
            f"--gpus={gpus}, --nodes={nodes}, --gpu-memory={gpu_memory_gb}: give positive numbers"
        )
    world = gpus * nodes
    c = config.model.build_config()
    config.micro_batch_size(world)  # the batch must split over the ranks (TrainConfigError names the fix)
    params = model_params(c)
    options = ep_sizes(c.num_experts, world) if ep_options is None else list(ep_options)
    budget = (gpu_memory_gb - headroom_gb) * GIB
    layouts, skipped = [], []
    for ep in options:
        if ep not in ep_sizes(c.num_experts, world):
            skipped.append(f"ep_size={ep} does not divide the world {world} and num_experts={c.num_experts}")
            continue
        for mode in dict.fromkeys(dp_modes if world > 1 else ("ddp",)):
            for ckpt in checkpointing:
                layout = evaluate_layout(config, params, world, ep, mode, ckpt)
                layout.fits = layout.peak <= budget
                layouts.append(layout)
    return Plan(
        config.model.preset, world, gpus, nodes, gpu_memory_gb, headroom_gb, config.batch_size,
        config.grad_accum, config.data.seq_len, config.precision, sum(p.nbytes for p in params),
        layouts, skipped, activation_caveats(c),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ printing
def _gib(n: int) -> str:
    return f"{n / GIB:.2f}" if n >= GIB / 100 else f"{n / 2**20:.1f}M"


def plan_table(plan: Plan) -> str:
    """The plan as a table (GiB per rank; 'M' marks MiB), the recommendation last."""
    head = (
        f"moe-lab plan: {plan.model} on {plan.world} rank(s) ({plan.nodes} node(s) x {plan.gpus} GPU(s), "
        f"{plan.gpu_memory_gb:g} GiB each, headroom {plan.headroom_gb:g}); batch {plan.batch_size}, "
        f"grad_accum {plan.grad_accum}, seq_len {plan.seq_len}, {plan.precision}; whole model "
        f"{_gib(plan.whole_model_bytes)} GiB fp32"
    )
    cols = f"{'layout':<24} {'micro':>5} {'weights':>8} {'grads':>8} {'AdamW':>8} {'activ.':>8} {'a2a':>8} "
    cols += f"{'dp buf':>8} {'peak':>8} {'comm/step':>10} {'fits':>4}"
    lines = [head, cols]
    for x in plan.layouts:
        sizes = (
            x.weights,
            x.grads,
            x.optimizer,
            x.activations,
            x.all_to_all_buffers,
            x.data_parallel_buffers,
        )
        lines.append(
            f"{x.name:<24} {x.micro_batch:>5} "
            + " ".join(f"{_gib(s):>8}" for s in sizes)
            + f" {_gib(x.peak):>8} {_gib(x.comm_total):>10} {'yes' if x.fits else 'no':>4}"
        )
    lines += [f"skipped: {s}" for s in plan.skipped]
    lines += [f"activations approximate: {caveat}" for caveat in plan.activation_caveats]
    rec = plan.recommended
    lines.append(
        f"recommended: {rec.name} (peak {_gib(rec.peak)} GiB per rank; set parallel.ep_size={rec.ep_size} "
        f"parallel.dp_mode={rec.dp_mode} activation_checkpointing={str(rec.activation_checkpointing).lower()})"
        if rec
        else "recommended: none fits; add GPUs, lower batch_size / data.seq_len, or raise grad_accum"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the check
def check_layout(config: TrainConfig, world: int, memory_bytes: int | None) -> Layout:
    """`moe-lab train`'s check before it allocates: ``parallel.ep_size`` divides the world and the experts, and
    (``memory_bytes`` given: the device's, per rank) the layout's predicted peak fits. Raises `PlanError` with
    the planner's numbers; returns the layout."""
    c = config.model.build_config()
    p = config.parallel
    valid = ep_sizes(c.num_experts, world)
    if p.ep_size not in valid:
        raise PlanError(
            f"parallel.ep_size={p.ep_size} must divide the world size {world} and num_experts="
            f"{c.num_experts}; the planner's choices here: {', '.join(map(str, valid))} "
            f"(`moe-lab plan --gpus {world} --gpu-memory GB` compares them)"
        )
    device = "cpu" if config.device == "cpu" or not torch.cuda.is_available() else "cuda"
    layout = evaluate_layout(
        config, model_params(c), world, p.ep_size, p.dp_mode, config.activation_checkpointing, device
    )
    if memory_bytes is not None and layout.peak > memory_bytes:
        raise PlanError(
            f"layout {layout.name} does not fit: predicted peak {_gib(layout.peak)} GiB per rank (weights "
            f"{_gib(layout.weights)}, grads {_gib(layout.grads)}, AdamW {_gib(layout.optimizer)}, activations "
            f"{_gib(layout.activations)} at {layout.micro_batch} x {config.data.seq_len} tokens) > "
            f"{_gib(memory_bytes)} GiB available; run `moe-lab plan --gpus {world} --gpu-memory GB` for the "
            "layouts that fit, or lower batch_size / data.seq_len, raise grad_accum, set "
            "activation_checkpointing=true or parallel.dp_mode=fsdp2"
        )
    return layout
