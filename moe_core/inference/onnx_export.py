"""ONNX export through PyTorch's own exporter, with a KV cache, and the lab's ONNX Runtime generation wrapper.

    from moe_core.inference import export_onnx, load_onnx
    export_onnx(model_or_dir, "out/onnx")                 # model.onnx (with KV cache) + config.json
    ort_model = load_onnx("out/onnx")                     # an OrtCausalLM over an ONNX Runtime session
    ort_model.generate(input_ids, max_new_tokens=20)

or ``moe-lab export onnx MODEL_DIR --out DIR``. Hugging Face checkpoints (every architecture `moe_core.convert`
reads) are converted exactly with `moe_core.convert.from_hf` first and exported as ``moe_lab``.

How it works (torch 2.13's ``torch.onnx.export(..., dynamo=True)``: ``torch.export`` in non-strict mode, then
onnxscript's translation; no optimum, so the lab is not tied to the transformers range optimum-onnx supports):
- `DecoderWithPast` is the exported forward: ``input_ids``, ``attention_mask`` (past + new positions),
  ``position_ids`` and ``past_key_values.{i}.key|value`` in, ``logits`` and ``present.{i}.key|value`` out, the
  input and output names optimum-onnx used (so older exports load too). Batch, sequence and past lengths
  are dynamic; the past is empty ([B, G, 0, Hd]) on the first step. The cache the model sees is `GraphCache`,
  ours: the three methods `MoEModel` calls on a cache, over plain tensors, so the graph does not depend on
  transformers' cache classes (which changed in transformers 5).
- Under ``torch.onnx.is_in_onnx_export()`` the experts resolve to the ``static`` implementation (every expert
  on every token: one wide FFN), so every expert's weights are in the graph whatever the sample input routed
  (`expert_weights_in_graph` checks that from the ONNX file). The ``sorted`` path's dispatch has shapes that
  depend on the routing; `export_onnx` refuses an explicit non-static ``expert_impl``.
- gpt-oss exports as it runs: its attention sinks and sliding-window masks are plain tensor ops of the model's
  attention, and the static path adds the experts' biases and applies the clamped SwiGLU
  (`tests/test_arch_gptoss_fast.py` validates a windowed layer past its window, with the cache).
- Capacity-bound routers (Switch, top-k with a capacity factor) drop the tokens over each expert's capacity,
  ``ceil(capacity_factor * T * K / E)``. ``T`` is symbolic under ``torch.export``, so the graph computes the
  capacity from each input's token count (`moe_core.routing.capacity_for`). A capacity computed as a Python
  int (``int(T)``) goes into the graph as the sample input's constant, and drops the wrong tokens at every other
  shape: the exporter lets it through, `validate_export` catches it.
- `linear_as_matmul` rewrites the exporter's ``Gemm`` nodes (``F.linear`` on the 2-D token matrix of the
  routers and experts) as ``MatMul`` against the transposed weight, and names every node by the module it
  came from (``/model/model/layers/0/mlp/router/...``): ONNX Runtime's dynamic int8 quantizes MatMul only,
  and tells the routers (kept in float) by that name.
- `export_onnx` checks its own output (`validate_export`): the graph holds every expert's weights, its logits
  equal PyTorch's at several batch x sequence shapes (one a repeated token, so a capacity-bound router drops
  tokens), and a prefill followed by a cached step equals PyTorch's. A failed check raises and
  leaves no export behind.
- `OrtCausalLM` (what `load_onnx` returns) runs the graph: a call gives logits and the present cache, and
  ``generate`` does greedy or sampled decoding with the cache (`moe_core.inference.onnx_export.OrtCausalLM`).
"""

from __future__ import annotations

# Lazy: onnx, onnxscript (through torch.onnx.export) and onnxruntime load inside the functions that export,
# load or inspect an ONNX graph: optional heavy dependencies, only for this backend.
import ast
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import GenerationConfig

from moe_core.config import MoEConfig
from moe_core.errors import MoELabError
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.loading import load
from moe_core.model import MoEForCausalLM
from moe_core.progress import Progress
from moe_core.quiet import quiet_onnx_exporter
from moe_core.routing import ExpertChoiceRouter
from moe_core.transformers_seam import generation_default

logger = logging.getLogger(__name__)

# what export_onnx writes, and what quantize_onnx_dynamic writes; decoder_model_merged.onnx: older optimum
# exports, which use the same input and output names
ONNX_FILES = ("model.onnx", "model_quantized.onnx", "decoder_model_merged.onnx")
DEFAULT_OPSET = 18  # the dynamo exporter's own opset; lower ones go through onnx's version converter


class OnnxExportError(MoELabError):
    """An ONNX export or load that cannot proceed; the message says why and what to do."""


# ------------------------------------------------------------------------------------------------ the graph
class GraphCache:
    """The KV cache `MoEModel` sees inside the exported graph: per-layer key and value tensors [B, G, P, Hd].

    It implements what the model calls on a cache (``update``, ``get_seq_length``, ``get_mask_sizes``, the
    signatures of transformers 5's ``DynamicCache``), appending each step's keys and values by concatenation,
    so the graph takes the past as inputs and returns the present as outputs."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = list(keys), list(values)
        self.past_length = keys[0].shape[-2] if keys else 0

    def update(self, k_BGSHd, v_BGSHd, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k_BGSHd], dim=-2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], v_BGSHd], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0):
        return self.past_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple:
        return self.past_length + query_length, 0


class DecoderWithPast(nn.Module):
    """The exported forward: (ids, mask, positions, past) -> (logits, present); without past: logits only."""

    def __init__(self, model: MoEForCausalLM, with_past: bool = True) -> None:
        super().__init__()
        self.model = model
        self.with_past = with_past

    def forward(self, input_ids_BS, attention_mask_BL, position_ids_BS, past_key_values=None):
        if not self.with_past:
            return self.model(
                input_ids=input_ids_BS,
                attention_mask=attention_mask_BL,
                position_ids=position_ids_BS,
                use_cache=False,
            ).logits
        cache = GraphCache([k for k, _ in past_key_values], [v for _, v in past_key_values])
        logits = self.model(
            input_ids=input_ids_BS,
            attention_mask=attention_mask_BL,
            position_ids=position_ids_BS,
            cache=cache,
            use_cache=True,
        ).logits
        return logits, list(zip(cache.keys, cache.values))


def io_names(num_layers: int, with_past: bool) -> tuple[list[str], list[str]]:
    """Graph input and output names, in the exporter's flattening order (optimum-onnx's names)."""
    inputs, outputs = ["input_ids", "attention_mask", "position_ids"], ["logits"]
    if with_past:
        for i in range(num_layers):
            inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def sample_inputs(config: MoEConfig, with_past: bool) -> tuple[tuple, tuple]:
    """Example inputs and their dynamic dims. Sizes are distinct and above 1 (torch.export specializes a
    dimension of size 0 or 1, and would take equal sizes for one symbol); the past is not empty here, and
    empty at run time on the first step."""
    from torch.export import Dim

    B, S, P = 2, 5, 3
    generator = torch.Generator().manual_seed(0)
    input_ids_BS = torch.randint(0, config.vocab_size, (B, S), generator=generator)
    attention_mask_BL = torch.ones(B, P + S, dtype=torch.long)
    position_ids_BS = torch.arange(P, P + S)[None].expand(B, S).contiguous()
    dyn = Dim.DYNAMIC
    args = (input_ids_BS, attention_mask_BL, position_ids_BS)
    shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn})
    if not with_past:
        attention_mask_BL = torch.ones(B, S, dtype=torch.long)
        return (input_ids_BS, attention_mask_BL, torch.arange(S)[None].expand(B, S).contiguous()), shapes
    G, Hd = config.num_key_value_heads, config.head_dim
    past = [
        (torch.randn(B, G, P, Hd, generator=generator), torch.randn(B, G, P, Hd, generator=generator))
        for _ in range(config.num_hidden_layers)
    ]
    past_shapes = [({0: dyn, 2: dyn}, {0: dyn, 2: dyn}) for _ in past]
    return (*args, past), (*shapes, past_shapes)


def linear_as_matmul(model_proto) -> None:
    """In place: each ``Gemm`` (``Y = A B^T``, no bias, ``alpha = 1``: ``F.linear`` of a 2-D input) becomes a
    ``MatMul`` of A and the transposed weight, and every node is named by its module path from the exporter's
    ``pkg.torch.onnx.name_scopes`` metadata (``/model/model/layers/0/mlp/router/linear_4``).

    ONNX Runtime's dynamic quantizer quantizes ``MatMul`` nodes, not ``Gemm``; `weight_matmuls` tells the
    routers by the ``/router/`` in these names."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model_proto.graph
    inits = {init.name: init for init in graph.initializer}
    transposed: dict[str, str] = {}
    nodes = []
    for node in graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        scopes = (
            ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
            if "pkg.torch.onnx.name_scopes" in meta
            else []
        )
        module_path = next((s for s in reversed(scopes[:-1]) if s), "")
        if module_path:
            node.name = "/" + module_path.replace(".", "/") + "/" + node.name
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = (
            node.op_type == "Gemm"
            and len(node.input) == 2
            and attrs.get("transA", 0) == 0
            and attrs.get("alpha", 1.0) == 1.0
        )
        if not plain:
            nodes.append(node)
            continue
        a, b = node.input
        if attrs.get("transB", 0):
            if b in inits:  # transpose the initializer once, here
                if b not in transposed:
                    array = numpy_helper.to_array(inits[b])
                    t_init = numpy_helper.from_array(np.ascontiguousarray(array.T), b + ".T")
                    graph.initializer.append(t_init)
                    transposed[b] = t_init.name
                b = transposed[b]
            else:  # a weight computed in the graph (a reshaped expert stack): ONNX Runtime folds it
                if b not in transposed:
                    nodes.append(
                        helper.make_node("Transpose", [b], [b + ".T"], name=node.name + "/Transpose")
                    )
                    transposed[b] = b + ".T"
                b = transposed[b]
        matmul = helper.make_node("MatMul", [a, b], list(node.output), name=node.name)
        matmul.metadata_props.extend(node.metadata_props)
        nodes.append(matmul)
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    onnx.checker.check_model(model_proto)


# ------------------------------------------------------------------------------------------------ export
def _load_for_export(source: str | os.PathLike | MoEForCausalLM) -> MoEForCausalLM:
    """A model as given, or any checkpoint kind `moe_core.load` reads (a Hugging Face MoE is converted)."""
    if isinstance(source, MoEForCausalLM):
        return source
    return load(source, dtype=torch.float32, merged=True).model  # a fine-tune's adapter merged in


def check_exportable(model: MoEForCausalLM) -> None:
    """Refuse, before tracing, what the exported graph would not compute for every routing."""
    impl = model.config.expert_impl
    if impl not in ("auto", "static"):
        raise OnnxExportError(
            f"config.expert_impl={impl!r}: a traced {impl!r} path has shapes that depend on the sample's "
            "routing; set model.config.expert_impl='auto' (static under export) or 'static' before exporting"
        )
    if getattr(model.config, "attention_type", "mha") == "mla":
        raise OnnxExportError(
            "attention_type='mla' (DeepSeek multi-head latent attention): the exported graph's KV-cache inputs "
            "are per-layer [B, num_key_value_heads, L, head_dim] keys and values, while MLA caches its compressed "
            "latent [B, 1, L, kv_lora_rank] and RoPE key [B, 1, L, qk_rope_head_dim]; ONNX export of MLA is not "
            "supported yet (run it with moe_core / transformers, or export a grouped-query-attention model)"
        )
    if any(isinstance(module, ExpertChoiceRouter) for module in model.modules()):
        raise OnnxExportError(
            "router 'expert_choice' picks each expert's tokens across the whole batch, which the "
            "traced graph does not reproduce; export a token-choice model (topk, switch, aux_free)"
        )
    for module in model.modules():  # a model swapped by enable_fast_decode/quantize keeps its own impl field
        if getattr(module, "impl", "auto") not in ("auto", "static"):
            raise OnnxExportError(
                f"{type(module).__name__}.impl={module.impl!r}; export needs 'auto' or 'static'"
            )


def export_onnx(
    source: str | os.PathLike | MoEForCausalLM,
    out_dir: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    with_past: bool = True,
    validate: bool = True,
    atol: float = 1e-4,
    overwrite: bool = False,
) -> Path:
    """Export a model (object, our checkpoint directory, or a HF Mixtral/OLMoE/Qwen2-MoE directory) to ONNX.

    Writes ``model.onnx`` (with ``with_past``: one graph taking ``past_key_values.*``, empty on the first step,
    and returning ``present.*``), ``config.json`` and ``generation_config.json``; `load_onnx` runs it.
    ``validate`` runs `validate_export` at ``atol`` (every expert in the graph; logits at several shapes, with
    tokens dropped over capacity; a cached step); a failure raises `OnnxExportError` and leaves nothing in
    ``out_dir``. The directory is written whole or not at all; a non-empty one is replaced (once the new one
    is complete) only with ``overwrite``. Returns ``out_dir``.
    """
    import onnx

    check_output_dir(out_dir, overwrite, OnnxExportError)  # before anything expensive
    model = _load_for_export(source).float().eval()
    check_exportable(model)
    out_dir = Path(out_dir)
    args, dynamic_shapes = sample_inputs(model.config, with_past)
    input_names, output_names = io_names(model.config.num_hidden_layers, with_past)
    bar = Progress(3 if validate else 2, "export onnx", unit="stage")
    with atomic_directory(out_dir, overwrite, OnnxExportError) as tmp:
        bar.stage("torch.export and translate (torch.onnx, dynamo)")
        try:
            with torch.no_grad(), quiet_onnx_exporter():
                program = torch.onnx.export(
                    DecoderWithPast(model, with_past).eval(),
                    args,
                    dynamo=True,
                    dynamic_shapes=dynamic_shapes,
                    input_names=input_names,
                    output_names=output_names,
                    opset_version=opset,
                    verbose=False,
                )
        except Exception as err:  # the exporter wraps the cause in a long report: name the cause
            cause = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise OnnxExportError(
                f"torch.onnx.export (dynamo) failed: {type(cause).__name__}: {first}; the model's code on the "
                "exported path is not torch.export-friendly there (the traceback above says where)"
            ) from err
        bar.stage("MatMul form, write")
        proto = program.model_proto
        linear_as_matmul(proto)
        # protobuf holds at most 2 GiB: larger weights go to model.onnx.data beside the graph
        large = sum(len(init.raw_data) for init in proto.graph.initializer) > 2**31 - 2**27
        onnx.save(proto, str(tmp / "model.onnx"), save_as_external_data=large, location="model.onnx.data")
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        if validate:
            bar.stage("validate every expert at several shapes")
            validate_export(model, tmp, atol=atol)
    bar.advance_to(bar.total)
    bar.close()
    return out_dir


# (batch, sequence) shapes the export is checked at; the last row repeats one token, so a capacity-bound
# router sends most tokens to one expert and drops the overflow
VALIDATION_SHAPES = ((1, 8), (2, 24), (4, 64), (2, 48))


@torch.no_grad()
def validate_export(
    model: MoEForCausalLM,
    onnx_dir: str | os.PathLike,
    *,
    atol: float = 1e-4,
    shapes: tuple[tuple[int, int], ...] = VALIDATION_SHAPES,
    seed: int = 0,
) -> list[dict]:
    """Check an export against its PyTorch model; raise `OnnxExportError` on any difference.

    The graph must hold every expert's weights (`expert_weights_in_graph`), and at each ``(batch, seq)`` shape
    the ONNX logits must equal PyTorch's within ``atol * max(1, max|logits|)``. Shapes other than the
    exporter's sample input are what catch a routing quantity frozen into the graph as a constant (an expert
    capacity drops other tokens once T changes). A graph with a KV cache is also run as a prefill of all but
    the last 3 tokens of the first shape and one cached step over those 3, whose logits must equal PyTorch's
    same cached step (the past is read, positions and mask line up).
    Returns one row per shape: max abs difference and slots dropped."""
    config = model.config
    onnx_dir = Path(onnx_dir)
    file_name = next((c for c in ONNX_FILES if (onnx_dir / c).is_file()), "model.onnx")
    if config.num_experts > 0:
        found, expected = (
            expert_weights_in_graph(onnx_dir / file_name, config),
            expected_expert_weights(config),
        )
        if found != expected:
            raise OnnxExportError(
                f"{onnx_dir / file_name}: the graph holds {found} expert weight matrices, a complete "
                f"export {expected}; the exporter kept only some experts"
            )
    ort_model = load_onnx(onnx_dir, file_name=file_name)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i, (batch, seq) in enumerate(shapes):
        seq = min(seq, config.max_position_embeddings)
        input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        if i == len(shapes) - 1:
            input_ids[:] = input_ids[0, 0]
        attention_mask = torch.ones_like(input_ids)
        out = model(input_ids, attention_mask=attention_mask, output_routing=True)
        got = ort_model(input_ids=input_ids, attention_mask=attention_mask).logits
        diff = (out.logits - got).abs().max().item()
        dropped = sum(int(r.dropped_TK.sum()) for r in (out.routing or ()))
        rows.append({"batch": batch, "seq": seq, "max_abs_diff": diff, "dropped_slots": dropped})
        limit = atol * max(1.0, out.logits.abs().max().item())
        if not diff <= limit:
            raise OnnxExportError(
                f"ONNX logits differ from PyTorch by {diff:.3g} (limit {limit:.3g}) at batch {batch} x seq {seq} "
                f"({dropped} routed slots dropped over capacity); the graph does not compute what the model does "
                "at this shape, so it is not written"
            )
        if i == 0 and ort_model.has_past and seq > 3:
            prefill = ort_model(input_ids=input_ids[:, :-3], attention_mask=attention_mask[:, :-3])
            step = ort_model(
                input_ids=input_ids[:, -3:],
                attention_mask=attention_mask,
                past_key_values=prefill.past_key_values,
            )
            # against PyTorch's own prefill and cached step: a capacity-bound router's capacity depends on the
            # tokens of one forward, so the full pass is not the reference for a split one
            ref_prefill = model(input_ids[:, :-3], attention_mask=attention_mask[:, :-3], use_cache=True)
            ref_step = model(input_ids[:, -3:], attention_mask=attention_mask, cache=ref_prefill.cache).logits
            step_diff = (ref_step - step.logits).abs().max().item()
            if not step_diff <= atol * max(1.0, ref_step.abs().max().item()):
                raise OnnxExportError(
                    f"ONNX logits of a cached step differ from PyTorch's by {step_diff:.3g} at batch {batch}: "
                    "the graph's KV cache does not compute what the model does, so it is not written"
                )
    logger.info("ONNX export checked at %s", rows)
    return rows


# ------------------------------------------------------------------------------------------------ ONNX Runtime
@dataclass
class OrtCausalLMOutput:
    """``logits`` [B, S, V]; ``past_key_values``: per layer (key, value) [B, G, P+S, Hd], or None."""

    logits: torch.Tensor
    past_key_values: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None


class OrtCausalLM:
    """An exported decoder in an ONNX Runtime session: a call gives logits (and the present KV cache), and
    ``generate`` decodes greedily or by sampling with the cache. ``config`` is the model's `MoEConfig`.

    A call mirrors `MoEForCausalLM.forward`: ``position_ids`` default to the positions after the past
    (as the model's own default); ``generate`` derives them from the attention mask, as transformers'
    generation does, so left-padded batches decode like ``model.generate``."""

    def __init__(self, session, config: MoEConfig, generation_config: GenerationConfig, path: Path) -> None:
        self.session = session
        self.config = config
        self.generation_config = generation_config
        self.path = path
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        self.has_past = "past_key_values.0.key" in self.input_names
        self.num_layers = config.num_hidden_layers
        self.device = torch.device("cpu")
        expected = set(io_names(self.num_layers, self.has_past)[0])
        if set(self.input_names) != expected:
            raise OnnxExportError(
                f"{path}: the graph's inputs {sorted(set(self.input_names) ^ expected)} differ from an export of "
                f"this config ({self.num_layers} layers); export again with `moe-lab export onnx`"
            )

    def empty_past(self, batch: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The first step's cache: [B, G, 0, Hd] per layer."""
        shape = (batch, self.config.num_key_value_heads, 0, self.config.head_dim)
        return tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(self.num_layers))

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = True,
    ) -> OrtCausalLMOutput:
        input_ids = torch.as_tensor(input_ids)
        B, S = input_ids.shape
        past = past_key_values
        if self.has_past and past is None:
            past = self.empty_past(B)
        P = past[0][0].shape[-2] if self.has_past else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, P + S, dtype=torch.long)
        if position_ids is None:  # the model's default: the positions after the past
            position_ids = torch.arange(P, P + S)[None].expand(B, S)
        feeds = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(torch.as_tensor(attention_mask), dtype=np.int64),
            "position_ids": np.ascontiguousarray(torch.as_tensor(position_ids), dtype=np.int64),
        }
        if self.has_past:
            for i, (k, v) in enumerate(past):
                feeds[f"past_key_values.{i}.key"] = np.ascontiguousarray(k, dtype=np.float32)
                feeds[f"past_key_values.{i}.value"] = np.ascontiguousarray(v, dtype=np.float32)
        outputs = dict(zip(self.output_names, self.session.run(None, feeds)))
        present = None
        if self.has_past and use_cache:
            present = tuple(
                (
                    torch.from_numpy(outputs[f"present.{i}.key"]),
                    torch.from_numpy(outputs[f"present.{i}.value"]),
                )
                for i in range(self.num_layers)
            )
        return OrtCausalLMOutput(logits=torch.from_numpy(outputs["logits"]), past_key_values=present)

    forward = __call__

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 20,
        min_new_tokens: int = 0,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Prompt [B, S] followed by up to ``max_new_tokens`` tokens, as ``transformers``' ``generate`` returns
        them: greedy (``do_sample=False``) or sampled at ``temperature`` from the ``top_k`` / ``top_p``
        (nucleus) set, with ``generator`` for a repeatable draw; ``eos_token_id`` is held back until
        ``min_new_tokens``, and a row that ended is padded with ``pad_token_id`` until every row ends.
        Defaults come from the export's ``generation_config.json``, as they do for ``model.generate``."""
        gen = self.generation_config
        eos = gen.eos_token_id if eos_token_id is None else eos_token_id
        eos_ids = torch.tensor(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), dtype=torch.long
        )
        pad = pad_token_id if pad_token_id is not None else gen.pad_token_id
        if pad is None and eos_ids.numel():
            pad = int(eos_ids[0])
        if do_sample:
            # unset in generation_config.json: transformers 5's defaults, as model.generate takes them
            temperature = generation_default(gen, "temperature") if temperature is None else temperature
            top_k = generation_default(gen, "top_k") if top_k is None else top_k
            top_p = generation_default(gen, "top_p") if top_p is None else top_p
            if not temperature or temperature <= 0:
                raise OnnxExportError(f"generate: temperature={temperature} must be > 0 when sampling")
        if not self.has_past:
            raise OnnxExportError(
                f"{self.path}: exported without a KV cache (with_past=False); export with it"
            )
        input_ids = torch.as_tensor(input_ids)
        B = input_ids.shape[0]
        mask = (
            torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).long()
        )
        sequences, step_ids, past = input_ids, input_ids, None
        unfinished = torch.ones(B, dtype=torch.bool)
        for step in range(max_new_tokens):
            # transformers' prepare_inputs_for_generation: positions count the unmasked tokens
            position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -step_ids.shape[1] :]
            out = self(step_ids, attention_mask=mask, position_ids=position_ids, past_key_values=past)
            past = out.past_key_values
            scores_BV = out.logits[:, -1].float()
            if step < min_new_tokens and eos_ids.numel():  # ids past the vocabulary are ignored, as in HF
                vocab_V = torch.arange(scores_BV.shape[-1])
                scores_BV[:, torch.isin(vocab_V, eos_ids)] = -float("inf")
            if do_sample:
                next_B = torch.multinomial(
                    filtered_probs(scores_BV / temperature, top_k, top_p), 1, generator=generator
                ).squeeze(1)
            else:
                next_B = scores_BV.argmax(-1)
            if eos_ids.numel():
                next_B = torch.where(unfinished, next_B, torch.full_like(next_B, pad))
                unfinished &= ~torch.isin(next_B, eos_ids)
            sequences = torch.cat([sequences, next_B[:, None]], dim=1)
            step_ids = next_B[:, None]
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
            if not unfinished.any():
                break
        return sequences


def filtered_probs(scores_BV: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Softmax over the ``top_k`` highest scores, then over the smallest set whose mass reaches ``top_p``
    (transformers' TopK and TopP logits warpers, in that order; the best token always stays)."""
    if top_k:
        kth_B1 = scores_BV.topk(min(top_k, scores_BV.shape[-1]), dim=-1).values[:, -1:]
        scores_BV = scores_BV.masked_fill(scores_BV < kth_B1, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = scores_BV.sort(dim=-1, descending=False)
        cum_BV = sorted_BV.softmax(-1).cumsum(-1)
        drop_BV = cum_BV <= 1 - top_p
        drop_BV[:, -1] = False
        scores_BV = scores_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), -float("inf"))
    return scores_BV.softmax(-1)


def load_onnx(
    onnx_dir: str | os.PathLike,
    *,
    file_name: str | None = None,
    provider: str = "CPUExecutionProvider",
    session_options=None,
) -> OrtCausalLM:
    """An `OrtCausalLM` over an exported directory (``model.onnx`` or ``model_quantized.onnx`` and its
    ``config.json``); ``session_options``: an ``onnxruntime.SessionOptions`` (threads, optimization level)."""
    import onnxruntime as ort

    onnx_dir = Path(onnx_dir)
    if not onnx_dir.is_dir():
        raise OnnxExportError(f"{onnx_dir}: no such directory; export first with `moe-lab export onnx`")
    if file_name is None:
        file_name = next((c for c in ONNX_FILES if (onnx_dir / c).is_file()), None)
        if file_name is None:
            found = sorted(p.name for p in onnx_dir.glob("*.onnx"))
            raise OnnxExportError(
                f"{onnx_dir}: none of {list(ONNX_FILES)} found (have {found}); pass file_name="
            )
    if not (onnx_dir / "config.json").is_file():
        raise OnnxExportError(
            f"{onnx_dir}: no config.json beside {file_name}; export again with `moe-lab export onnx`"
        )
    config_dict = json.loads((onnx_dir / "config.json").read_text())
    if config_dict.get("model_type") != MoEConfig.model_type:
        raise OnnxExportError(
            f"{onnx_dir / 'config.json'}: model_type {config_dict.get('model_type')!r}, not "
            f"{MoEConfig.model_type!r}; `moe-lab export onnx` writes the config this loader reads"
        )
    config = MoEConfig.from_pretrained(onnx_dir)
    if (onnx_dir / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(onnx_dir)
    else:
        generation_config = GenerationConfig.from_model_config(config)
    session = ort.InferenceSession(
        str(onnx_dir / file_name), sess_options=session_options, providers=[provider]
    )
    return OrtCausalLM(session, config, generation_config, onnx_dir)


# ------------------------------------------------------------------------------------------------ inspection
def expert_weights_in_graph(onnx_path: str | os.PathLike, config: MoEConfig) -> int:
    """How many expert weight matrices the ONNX graph holds, read from its initializers.

    The static path keeps each projection of a layer as one initializer holding all E experts: the stack
    ``[E, F, D]`` / ``[E, D, F]``, a transpose of it, or, once the exporter or ONNX Runtime folds the reshape,
    the wide matrix ``[E*F, D]`` / ``[D, E*F]``; each counts E. A complete export holds
    `expected_expert_weights` of them. An exporter that kept only the experts its sample input reached would
    hold smaller matrices, which do not count, so the check fails.
    """
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    E, F_, D = config.num_experts, config.expert_intermediate_size, config.hidden_size
    full = {tuple(sorted((E, F_, D))), tuple(sorted((E * F_, D)))}
    return sum(E for init in model.graph.initializer if tuple(sorted(init.dims)) in full)


def expected_expert_weights(config: MoEConfig) -> int:
    """Expert weight matrices in a complete export: 3 per expert and MoE layer (SwiGLU), 2 for GELU experts."""
    matrices = 3 if config.ffn_activation == "swiglu" else 2
    return matrices * config.num_experts * len(config.moe_layer_ids)
