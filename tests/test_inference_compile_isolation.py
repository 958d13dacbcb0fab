"""Compiling one model (`compile_steps` on a static cache) changes no global state: another model in the
same process, ``torch.nn.functional.scaled_dot_product_attention`` and the ``nn.Linear`` class stay as they
were, also while the compiled steps run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.compile import ReductionLinear, compile_steps

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(seed: int) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(get_config("mixtral-tiny", vocab_size=128, num_hidden_layers=1)).eval()


@torch.no_grad()
def test_compiling_one_model_leaves_the_process_and_other_models_alone():
    sdpa, linear_forward = F.scaled_dot_product_attention, nn.Linear.forward
    compiled, other = tiny(0), tiny(1)
    prompt = torch.randint(0, 128, (1, 5))
    other_logits = other(prompt).logits
    eager_tokens = compiled.generate(prompt, max_new_tokens=3, do_sample=False)

    # what the attention sees while the compiled steps run: recorded by an eager (graph-breaking) pre-hook
    seen = []

    @torch.compiler.disable
    def record(module, args, kwargs):
        seen.append(torch.nn.functional.scaled_dot_product_attention)

    compiled.model.layers[0].self_attn.register_forward_pre_hook(record, with_kwargs=True)
    # the decode step is compiled (the eager backend: dynamo's graph capture without inductor's build)
    steps = compile_steps(
        compiled, backend="eager", fullgraph=False, cache="static", max_cache_len=16, compile_prefill=False
    )
    logits, state = steps.prefill(prompt)
    tokens = [logits.argmax(-1, keepdim=True)]
    for _ in range(2):
        logits, state = steps.decode(tokens[-1], state)
        tokens.append(logits.argmax(-1, keepdim=True))

    assert torch.equal(torch.cat([prompt, *tokens], dim=1), eager_tokens)  # the compiled steps did run
    assert len(seen) == 3 and all(f is sdpa for f in seen)  # never patched, not even meanwhile
    assert F.scaled_dot_product_attention is sdpa and nn.Linear.forward is linear_forward
    # the compiled model's linears were swapped for ReductionLinear modules; the other model's were not
    assert isinstance(compiled.lm_head, ReductionLinear)
    assert all(type(m) is not ReductionLinear for m in other.modules())
    assert torch.equal(other(prompt).logits, other_logits)
