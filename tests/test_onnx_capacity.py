"""ONNX export of capacity-routed models: the expert capacity is computed in the graph from each input's token
count, so ONNX equals PyTorch at every shape, also where tokens drop; the export's own check catches a capacity
frozen as a constant, and any graph that computes something else; the graph's KV-cache contract (README: what
a plain ONNX Runtime loop feeds it)."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime
import pytest
import torch

from moe_core import MoEForCausalLM, get_config, routing
from moe_core.inference.onnx_export import OnnxExportError, export_onnx, load_onnx, validate_export
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def switch_model(seed: int = 0, **overrides) -> MoEForCausalLM:
    torch.manual_seed(0)
    # eval capacity 1.0: capacity = ceil(T / E), so any imbalance drops tokens
    model = MoEForCausalLM(
        get_config("switch-tiny", vocab_size=96, eval_capacity_factor=1.0, **overrides)
    ).eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="module")
def switch_export(tmp_path_factory):
    """One validated export of the switch model (4 heads, 2 KV heads), shared by the tests that read it."""
    model = switch_model()
    out = tmp_path_factory.mktemp("switch") / "onnx"
    export_onnx(model, out)  # includes validate_export at several shapes and a cached step
    return model, out


def test_switch_export_matches_pytorch_at_shapes_that_drop_tokens(switch_export):
    model, out = switch_export
    ort = load_onnx(out)
    generator = torch.Generator().manual_seed(3)
    for batch, seq in [(1, 8), (3, 20), (4, 64), (2, 5)]:
        input_ids = torch.randint(0, 96, (batch, seq), generator=generator)
        with torch.no_grad():
            out_pt = model(input_ids, output_routing=True)
        assert sum(int(r.dropped_TK.sum()) for r in out_pt.routing) > 0, (
            "no token dropped: the check is vacuous"
        )
        got = ort(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        assert (out_pt.logits - got).abs().max().item() < 1e-4, (batch, seq)
    prompt = torch.randint(0, 96, (2, 6), generator=generator)  # decode steps: T = batch, a capacity of 1
    ref = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(ort.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False), ref)


def test_export_check_refuses_a_capacity_frozen_into_the_graph(tmp_path, monkeypatch):
    """The bug the tensor capacity replaced: capacity computed as a Python int from the sample input (the
    exporter lets it through as a constant). The export's own validation must see it and leave no export
    behind."""

    def frozen(capacity_factor, num_tokens, slots_per_token, num_experts):
        if capacity_factor is None:
            return None
        return max(1, math.ceil(capacity_factor * int(num_tokens) * slots_per_token / num_experts))

    monkeypatch.setattr(routing, "capacity_for", frozen)
    with pytest.raises(OnnxExportError, match="differ from PyTorch"):
        export_onnx(switch_model(), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_export_check_refuses_a_graph_that_computes_something_else(switch_export):
    """validate_export can fail: the same graph checked against a model with other weights."""
    _, out = switch_export
    with pytest.raises(OnnxExportError, match="differ from PyTorch"):
        validate_export(switch_model(seed=1), out)


def test_capacity_is_the_same_integer_traced_or_not():
    for factor in (1.0, 1.1, 1.25, 2.0, 0.3):
        for tokens in (1, 7, 8, 80, 513):
            for k, e in ((1, 8), (2, 8), (8, 64)):
                as_tensor = routing.capacity_for(factor, torch.tensor(tokens), k, e)
                assert int(as_tensor) == routing.capacity_for(factor, tokens, k, e), (factor, tokens, k, e)


def test_graph_cache_contract_in_plain_onnxruntime(switch_export):
    """README: the graph takes past_key_values.{i}.key|value [B, G, P, Hd] (G = KV heads, empty on the first
    step) and returns present.{i}.* [B, G, P+S, Hd]; a plain ONNX Runtime session runs it with those shapes
    (optimum's stock ORTModelForCausalLM sized the cache with the attention heads and failed on GQA)."""
    model, out = switch_export
    config = model.config
    G, Hd, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    assert G != config.num_attention_heads  # grouped-query, the case that needs the config's shape
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    declared = {i.name: i.shape for i in session.get_inputs()}
    assert declared["past_key_values.0.key"][1] == G and declared["past_key_values.0.key"][3] == Hd
    prompt = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    feeds = {
        "input_ids": prompt.numpy(),
        "attention_mask": np.ones((2, 6), np.int64),
        "position_ids": np.arange(6)[None].repeat(2, 0),
    }
    for i in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((2, G, 0, Hd), np.float32)
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, feeds)))
    assert outputs["present.0.key"].shape == (2, G, 6, Hd)
    with torch.no_grad():
        ref = model(prompt, use_cache=True)
    torch.testing.assert_close(torch.from_numpy(outputs["logits"]), ref.logits, atol=1e-4, rtol=0)
    ref_key = ref.cache.layers[0].keys  # the present cache is the model's own keys
    torch.testing.assert_close(torch.from_numpy(outputs["present.0.key"]), ref_key, atol=1e-5, rtol=0)


def test_expert_choice_export_is_refused_clearly(tmp_path):
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=96, router="expert_choice")).eval()
    with pytest.raises(OnnxExportError, match="expert_choice"):
        export_onnx(model, tmp_path / "onnx")
