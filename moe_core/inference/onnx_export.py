"""ONNX export through optimum-onnx, with a KV cache, and ONNX Runtime generation.

    from moe_core.inference import export_onnx, load_onnx
    export_onnx(model_or_dir, "out/onnx")                 # model.onnx (with KV cache) + config.json
    ort_model = load_onnx("out/onnx")                     # an optimum ORTModelForCausalLM
    ort_model.generate(input_ids, max_new_tokens=20)

or ``moe-lab export onnx MODEL_DIR --out DIR``. Hugging Face Mixtral / OLMoE / Qwen2-MoE checkpoints (which
optimum-onnx 0.1.0 does not support) are converted exactly with `moe_core.convert.from_hf` first and exported
as ``moe_lab``.

How it works (the truth is optimum-onnx 0.1.0's ``exporters/onnx`` and ``onnxruntime/modeling_decoder.py``):
- `MoELabOnnxConfig` is a ``TextDecoderWithPositionIdsOnnxConfig`` registered with optimum's `TasksManager`
  for ``model_type="moe_lab"`` (tasks ``text-generation[-with-past]``, ``feature-extraction[-with-past]``).
  Its normalized config reads ``num_key_value_heads`` and ``head_dim`` from our config, so the dummy KV cache
  has the grouped-query shape.
- optimum exports with the TorchScript tracer (``dynamo=False``). Under ``torch.jit.is_tracing()`` the
  experts resolve to the ``static`` implementation (every expert on every token: one wide FFN), so
  every expert's weights are in the graph whatever the dummy input routed (`expert_weights_in_graph`
  checks that from the ONNX file). A tracer on the ``sorted`` path would keep only the experts the dummy
  input hit: `export_onnx` refuses an explicit non-static ``expert_impl``.
- Capacity-bound routers (Switch, top-k with a capacity factor) drop the tokens over each expert's capacity,
  ``ceil(capacity_factor * T * K / E)``. Under the tracer ``T`` is a tensor, so the graph computes the capacity
  from each input's token count (`moe_core.routing.capacity_for`); a constant frozen at the sample input's
  shape would drop the wrong tokens at every other shape.
- `export_onnx` checks its own output (`validate_export`): the graph holds every expert's weights, and its
  logits equal PyTorch's at several batch x sequence shapes, one of them a repeated token so that a
  capacity-bound router drops tokens. A failed check raises and leaves no export behind.
- optimum's stock `ORTModelForCausalLM` assumes ``num_key_value_heads == num_attention_heads`` and ``head_dim ==
  hidden_size // num_attention_heads`` for a model type it does not know (optimum-onnx 0.1.0,
  ``onnxruntime/modeling_decoder.py``, ``ORTModelForCausalLM.__init__``: it builds the empty first-step cache
  from them and has no hook for another model type). So the stock class loads exports of models with as many
  KV heads as attention heads, and fails on grouped-query ones (``Got invalid dimensions for input:
  past_key_values.0.key``); `MoEORTModelForCausalLM` sets both from the config. `load_onnx` returns one and
  works for every export.
"""

from __future__ import annotations

# Lazy: optimum (seconds to import) and onnx load inside the functions that export, load or inspect an ONNX
# graph; the classes built on optimum's are made on first use (`onnx_config_class`, `ort_model_class`).
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from moe_core.config import MoEConfig
from moe_core.errors import MoELabError
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.loading import load
from moe_core.model import MoEForCausalLM
from moe_core.progress import Progress
from moe_core.quiet import quiet_tracer_warnings
from moe_core.routing import ExpertChoiceRouter

logger = logging.getLogger(__name__)

ONNX_TASKS = (
    "text-generation",
    "text-generation-with-past",
    "feature-extraction",
    "feature-extraction-with-past",
)
# optimum-onnx 0.1 writes one graph, model.onnx; ORTQuantizer writes model_quantized.onnx
ONNX_FILES = ("model.onnx", "model_quantized.onnx", "decoder_model_merged.onnx")


class OnnxExportError(MoELabError):
    """An ONNX export or load that cannot proceed; the message says why and what to do."""


_REGISTERED: dict[str, type] = {}


def onnx_config_class() -> type:
    """Build (once) and register with optimum's TasksManager the OnnxConfig of ``model_type="moe_lab"``."""
    if "moe_lab" in _REGISTERED:
        return _REGISTERED["moe_lab"]
    from optimum.exporters.onnx.config import TextDecoderWithPositionIdsOnnxConfig
    from optimum.exporters.tasks import TasksManager
    from optimum.utils import (
        DummyTextInputGenerator,
        MistralDummyPastKeyValuesGenerator,
        NormalizedTextConfig,
    )

    class MoELabOnnxConfig(TextDecoderWithPositionIdsOnnxConfig):
        """``moe_lab`` decoder: position ids, GQA-shaped KV cache (``num_key_value_heads``, ``head_dim``)."""

        DEFAULT_ONNX_OPSET = 14
        DUMMY_INPUT_GENERATOR_CLASSES = (DummyTextInputGenerator, MistralDummyPastKeyValuesGenerator)
        DUMMY_PKV_GENERATOR_CLASS = MistralDummyPastKeyValuesGenerator
        NORMALIZED_CONFIG_CLASS = NormalizedTextConfig.with_args(
            num_key_value_heads="num_key_value_heads", head_dim="head_dim", allow_new=True
        )
        ATOL_FOR_VALIDATION = 1e-4

    register = TasksManager.create_register("onnx", overwrite_existing=True)
    register(MoEConfig.model_type, *ONNX_TASKS)(MoELabOnnxConfig)
    _REGISTERED["moe_lab"] = MoELabOnnxConfig
    return MoELabOnnxConfig


def _load_for_export(source: str | os.PathLike | MoEForCausalLM) -> MoEForCausalLM:
    """A model as given, or any checkpoint kind `moe_core.load` reads (a Hugging Face MoE is converted)."""
    if isinstance(source, MoEForCausalLM):
        return source
    return load(source, dtype=torch.float32).model


def export_onnx(
    source: str | os.PathLike | MoEForCausalLM,
    out_dir: str | os.PathLike,
    *,
    opset: int = 17,
    with_past: bool = True,
    validate: bool = True,
    atol: float = 1e-4,
    overwrite: bool = False,
) -> Path:
    """Export a model (object, our checkpoint directory, or a HF Mixtral/OLMoE/Qwen2-MoE directory) to ONNX.

    With ``with_past`` optimum writes ``model.onnx``, one graph taking ``past_key_values.*`` (empty on the
    first step) and returning ``present.*``, which `load_onnx` runs. ``validate`` runs optimum's output check
    at ``atol``, then `validate_export` (every expert in the graph; logits at several shapes, with tokens
    dropped over capacity); a failure raises `OnnxExportError` and leaves nothing in ``out_dir``. The directory
    is written whole or not at all; a non-empty one is replaced (once the new one is complete) only with
    ``overwrite``. Returns ``out_dir``.
    """
    from optimum.exporters.onnx import onnx_export_from_model

    check_output_dir(out_dir, overwrite, OnnxExportError)  # before anything expensive
    model = _load_for_export(source).float().eval()
    impl = model.config.expert_impl
    if impl not in ("auto", "static"):
        raise OnnxExportError(
            f"config.expert_impl={impl!r}: a traced {impl!r} path keeps only the experts the dummy input hit; "
            "set model.config.expert_impl='auto' (static under tracing) or 'static' before exporting"
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
    config_cls = onnx_config_class()
    task = "text-generation-with-past" if with_past else "text-generation"
    onnx_config = config_cls(model.config, task=task, use_past=with_past, use_past_in_inputs=with_past)
    out_dir = Path(out_dir)
    del onnx_config  # registered above; optimum builds its own instances (with and without past)
    bar = Progress(2 if validate and with_past else 1, "export onnx", unit="stage")
    with atomic_directory(out_dir, overwrite, OnnxExportError) as tmp:
        with torch.no_grad(), _library_is_transformers(), quiet_tracer_warnings():
            try:
                bar.stage("trace and check (optimum)")
                onnx_export_from_model(model, tmp, opset=opset, task=task, do_validation=validate, atol=atol)
            finally:
                # optimum's patcher "restores" forward by assigning the bound method to the instance; an instance
                # attribute changes the model for torch.compile (it recompiles and runs far slower), so drop it
                if "forward" in model.__dict__:
                    del model.forward
        if validate and with_past:
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
    the ONNX logits must equal PyTorch's within ``atol * max(1, max|logits|)``. Shapes other than the tracer's
    sample input are what catch a routing quantity frozen into the graph as a constant (an expert capacity
    drops other tokens once T changes). Returns one row per shape: max abs difference and slots dropped."""
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
                f"export {expected}; the tracer kept only some experts"
            )
    ort = load_onnx(onnx_dir, file_name=file_name)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i, (batch, seq) in enumerate(shapes):
        seq = min(seq, config.max_position_embeddings)
        input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        if i == len(shapes) - 1:
            input_ids[:] = input_ids[0, 0]
        attention_mask = torch.ones_like(input_ids)
        out = model(input_ids, attention_mask=attention_mask, output_routing=True)
        got = ort(input_ids=input_ids, attention_mask=attention_mask).logits
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
    logger.info("ONNX export checked at %s", rows)
    return rows


@contextmanager
def _library_is_transformers():
    """optimum infers the library from ``type(model).__module__`` (``transformers.*``); ours is a transformers
    `PreTrainedModel` living in ``moe_core``, so answer "transformers" for it while the export runs."""
    from optimum.exporters.tasks import TasksManager

    original = TasksManager.__dict__["_infer_library_from_model_or_model_class"]

    def infer(cls, model=None, model_class=None):
        target = model_class if model_class is not None else type(model)
        if isinstance(target, type) and issubclass(target, MoEForCausalLM):
            return "transformers"
        return original.__func__(cls, model=model, model_class=model_class)

    TasksManager._infer_library_from_model_or_model_class = classmethod(infer)
    try:
        yield
    finally:
        TasksManager._infer_library_from_model_or_model_class = original


def load_onnx(
    onnx_dir: str | os.PathLike,
    *,
    file_name: str | None = None,
    provider: str = "CPUExecutionProvider",
    session_options=None,
):
    """An `ORTModelForCausalLM` (GQA-aware subclass) over an exported directory; ``.generate`` works."""
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
    return ort_model_class().from_pretrained(
        onnx_dir, file_name=file_name, provider=provider, session_options=session_options
    )


_ORT_CLASS: list[type] = []


def ort_model_class() -> type:
    if _ORT_CLASS:
        return _ORT_CLASS[0]
    from optimum.onnxruntime import ORTModelForCausalLM

    class MoEORTModelForCausalLM(ORTModelForCausalLM):
        """`ORTModelForCausalLM` that takes the KV-cache shape from the config instead of assuming MHA."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if getattr(self.config, "model_type", None) == MoEConfig.model_type:
                self.num_key_value_heads = self.config.num_key_value_heads
                self.embed_size_per_head = self.config.head_dim

    _ORT_CLASS.append(MoEORTModelForCausalLM)
    return MoEORTModelForCausalLM


def expert_weights_in_graph(onnx_path: str | os.PathLike, config: MoEConfig) -> int:
    """How many expert weight matrices the ONNX graph holds, read from its initializers.

    The static path keeps each projection of a layer as one initializer holding all E experts: the stack
    ``[E, F, D]`` / ``[E, D, F]`` or, once the exporter folds the reshape, the wide matrix ``[E*F, D]`` /
    ``[D, E*F]`` (either orientation); each counts E. A complete export holds `expected_expert_weights`
    of them. An exporter that kept only the experts its dummy input reached would hold smaller matrices,
    which do not count, so the check fails.
    """
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    E, F_, D = config.num_experts, config.expert_intermediate_size, config.hidden_size
    full = {(E, F_, D), (E, D, F_), (E * F_, D), (D, E * F_)}
    return sum(E for init in model.graph.initializer if tuple(init.dims) in full)


def expected_expert_weights(config: MoEConfig) -> int:
    """Expert weight matrices in a complete export: 3 per expert and MoE layer (SwiGLU), 2 for GELU experts."""
    matrices = 3 if config.ffn_activation == "swiglu" else 2
    return matrices * config.num_experts * len(config.moe_layer_ids)
