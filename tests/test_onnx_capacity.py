"""ONNX export of capacity-routed models: the expert capacity is computed in the graph from each input's token
count, so ONNX equals PyTorch at every shape, also where tokens drop; the export's own check catches a capacity
frozen as a constant; and which ONNX Runtime loaders run the export (README claim)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_core import MoEForCausalLM, get_config, routing
from moe_core.inference.onnx_export import OnnxExportError, export_onnx, load_onnx
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def switch_model(**overrides) -> MoEForCausalLM:
    torch.manual_seed(0)
    # eval capacity 1.0: capacity = ceil(T / E), so any imbalance drops tokens
    model = MoEForCausalLM(
        get_config("switch-tiny", vocab_size=96, eval_capacity_factor=1.0, **overrides)
    ).eval()
    randomize_(model)
    return model


def test_switch_export_matches_pytorch_at_shapes_that_drop_tokens(tmp_path):
    model = switch_model()
    export_onnx(model, tmp_path / "onnx")  # includes validate_export at several shapes
    ort = load_onnx(tmp_path / "onnx")
    generator = torch.Generator().manual_seed(3)
    for batch, seq in [(1, 8), (3, 20), (4, 64), (2, 5)]:
        input_ids = torch.randint(0, 96, (batch, seq), generator=generator)
        with torch.no_grad():
            out = model(input_ids, output_routing=True)
        assert sum(int(r.dropped_TK.sum()) for r in out.routing) > 0, "no token dropped: the check is vacuous"
        got = ort(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        assert (out.logits - got).abs().max().item() < 1e-4, (batch, seq)
    prompt = torch.randint(0, 96, (2, 6), generator=generator)  # decode steps: T = batch, a capacity of 1
    ref = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(ort.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False), ref)


def test_export_check_refuses_a_capacity_frozen_into_the_graph(tmp_path, monkeypatch):
    """The bug this replaced: capacity computed as a Python int from the sample input. The export's own
    validation must see it and leave no export behind."""

    def frozen(capacity_factor, num_tokens, slots_per_token, num_experts):
        if capacity_factor is None:
            return None
        return max(1, math.ceil(capacity_factor * int(num_tokens) * slots_per_token / num_experts))

    monkeypatch.setattr(routing, "capacity_for", frozen)
    with pytest.raises(OnnxExportError, match="differ from PyTorch"):
        export_onnx(switch_model(), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_capacity_is_the_same_integer_traced_or_not():
    for factor in (1.0, 1.1, 1.25, 2.0, 0.3):
        for tokens in (1, 7, 8, 80, 513):
            for k, e in ((1, 8), (2, 8), (8, 64)):
                as_tensor = routing.capacity_for(factor, torch.tensor(tokens), k, e)
                assert int(as_tensor) == routing.capacity_for(factor, tokens, k, e), (factor, tokens, k, e)


def test_stock_ort_class_loads_exports_with_as_many_kv_heads_as_heads(tmp_path):
    """README: optimum's stock ORTModelForCausalLM runs exports of multi-head-attention models; grouped-query
    ones need load_onnx (the stock class sizes the empty cache with num_attention_heads for unknown types)."""
    from optimum.onnxruntime import ORTModelForCausalLM

    mha = switch_model(num_key_value_heads=4)
    export_onnx(mha, tmp_path / "mha", validate=False)
    stock = ORTModelForCausalLM.from_pretrained(tmp_path / "mha")
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = mha.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(stock.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False), ref)

    gqa = switch_model()  # switch-tiny: 4 heads, 2 KV heads
    export_onnx(gqa, tmp_path / "gqa", validate=False)
    with pytest.raises(Exception, match="past_key_values"):
        ORTModelForCausalLM.from_pretrained(tmp_path / "gqa")(
            input_ids=prompt, attention_mask=torch.ones_like(prompt)
        )
    got = load_onnx(tmp_path / "gqa").generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(got, gqa.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False))


def test_expert_choice_export_is_refused_clearly(tmp_path):
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=96, router="expert_choice")).eval()
    with pytest.raises(OnnxExportError, match="expert_choice"):
        export_onnx(model, tmp_path / "onnx")
