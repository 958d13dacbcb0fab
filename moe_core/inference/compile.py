"""``torch.compile`` of the prefill and decode steps, and ``torch.export`` of the forward, from outside.

    from moe_core.inference import compile_steps, export_program
    steps = compile_steps(model)                 # fullgraph on the export-friendly ``static`` expert path
    logits, cache = steps.prefill(input_ids)
    logits, cache = steps.decode(next_ids, cache)
    program = export_program(model, example_ids) # torch.export.ExportedProgram of the cache-free forward

Under compilation the experts resolve to ``static`` (every expert on every token with a dense combine
matrix), so the graph has no data-dependent shapes and ``fullgraph=True`` holds; it does E/K times the
expert FLOPs, which is the price of a single graph (on a CPU at batch 1 the eager decode path of
`moe_core.inference.fast_decode` is usually faster; the benchmark measures both). Prefill and decode are
compiled separately: prefill with static shapes (a graph per prompt length), decode with automatic dynamic
shapes (the growing KV cache recompiles once, not every step).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.errors import MoELabError


class CompileError(MoELabError):
    """torch.compile / torch.export could not handle the model; the message says what to try."""


_SDPA = F.scaled_dot_product_attention


def _sdpa_bool_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    # with a symbolic sequence length, ``is_causal = mask is None and S > 1`` is a SymBool, which SDPA rejects;
    # bool() makes the tracer guard on it instead (optimum's exporter patches SDPA the same way)
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=bool(is_causal), **kwargs)


@contextmanager
def traceable_sdpa():
    """Swap ``F.scaled_dot_product_attention`` for a wrapper that takes a symbolic ``is_causal``, meanwhile."""
    F.scaled_dot_product_attention = _sdpa_bool_causal
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


class _Step(nn.Module):
    """The model call a compiled step runs: logits of the last position and the updated cache."""

    def __init__(self, model: nn.Module, expert_impl: str) -> None:
        super().__init__()
        self.model, self.expert_impl = model, expert_impl

    def forward(self, input_ids_BS, past_key_values=None):
        out = self.model(input_ids=input_ids_BS, past_key_values=past_key_values, use_cache=True, logits_to_keep=1,
                         expert_impl=self.expert_impl)
        return out.logits[:, -1], out.past_key_values


@dataclass
class CompiledSteps:
    prefill: object
    decode: object


def compile_steps(model: nn.Module, *, fullgraph: bool = True, mode: str | None = None,
                  expert_impl: str = "static", backend: str = "inductor") -> CompiledSteps:
    """Compiled ``prefill(input_ids) -> (logits, cache)`` and ``decode(next_ids, cache) -> (logits, cache)``."""
    model.eval()
    step = _Step(model, expert_impl)
    # prefill: static shapes (one graph per prompt length; a symbolic length turns SDPA's is_causal into a
    # SymBool that dynamo cannot pass on); decode: S = 1 always, and the cache length goes dynamic after the
    # first recompile (dynamo's automatic dynamic shapes), so the growing cache does not recompile every step
    prefill = torch.compile(step, fullgraph=fullgraph, dynamic=False, mode=mode, backend=backend)
    decode = torch.compile(step, fullgraph=fullgraph, dynamic=None, mode=mode, backend=backend)

    def run_prefill(input_ids_BS):
        with torch.no_grad(), traceable_sdpa():
            return prefill(input_ids_BS)

    def run_decode(input_ids_BS, past_key_values):
        with torch.no_grad(), traceable_sdpa():
            return decode(input_ids_BS, past_key_values)

    return CompiledSteps(run_prefill, run_decode)


class _Forward(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids_BS):
        return self.model(input_ids=input_ids_BS, use_cache=False, expert_impl="static").logits


def export_program(model: nn.Module, example_input_ids: torch.Tensor, *, dynamic_seq: bool = True):
    """``torch.export`` of the cache-free forward (logits) on the static expert path."""
    from torch.export import Dim, export

    model.eval()
    dynamic_shapes = None
    if dynamic_seq:
        dynamic_shapes = {"input_ids_BS": {1: Dim("seq", min=2, max=4096)}}
    try:
        with torch.no_grad(), traceable_sdpa():
            return export(_Forward(model), (example_input_ids,), dynamic_shapes=dynamic_shapes)
    except Exception as err:  # surface the exporter's reason with what to try
        raise CompileError(f"torch.export failed on the static expert path: {type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}; try dynamic_seq=False") from err
