"""REAP pruning: saliency against a slow per-token loop, ranking by it, and the CLI's calibration data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.prune import (
    PruneConfig,
    PruneError,
    collect_saliency,
    collect_usage,
    prune_experts,
)
from tests.helpers import tiny_mixtral as tiny_model
from tests.helpers import token_ids as ids

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@torch.no_grad()
def slow_saliency(model, batches) -> dict[int, torch.Tensor]:
    """Token by token, slot by slot: g_e(x) * ||down_e(silu(gate_e x) * up_e x)||, averaged per expert."""
    inputs: dict[int, list] = {i: [] for i in model.config.moe_layer_ids}
    hooks = [
        model.model.layers[i].mlp.experts.register_forward_hook(
            lambda m, args, out, i=i: inputs[i].append((args[0].detach(), args[1]))
        )
        for i in model.config.moe_layer_ids
    ]
    with torch.no_grad():
        for x in batches:
            model(input_ids=x, use_cache=False)
    for h in hooks:
        h.remove()
    E = model.config.num_experts
    out = {}
    for i, calls in inputs.items():
        experts = model.model.layers[i].mlp.experts
        total, count = [0.0] * E, [0] * E
        for x_TD, record in calls:
            for t in range(x_TD.shape[0]):
                for k in range(record.expert_ids_TK.shape[1]):
                    if record.dropped_TK[t, k]:
                        continue
                    e = int(record.expert_ids_TK[t, k])
                    h = F.silu(experts.gate_proj[e] @ x_TD[t]) * (experts.up_proj[e] @ x_TD[t])
                    total[e] += float(record.weights_TK[t, k]) * float((experts.down_proj[e] @ h).norm())
                    count[e] += 1
        out[i] = torch.tensor([s / c if c else 0.0 for s, c in zip(total, count)])
    return out


def test_reap_saliency_matches_a_slow_reference_loop():
    model = tiny_model()
    batches = [ids(2, 12, seed=s) for s in range(2)]
    fast = collect_saliency(model, batches)
    slow = slow_saliency(model, batches)
    assert set(fast) == set(slow)
    for layer in fast:
        torch.testing.assert_close(fast[layer], slow[layer], rtol=1e-4, atol=1e-6)
        assert (fast[layer] > 0).any()


def test_reap_keeps_the_most_salient_experts_where_frequency_would_not():
    model = tiny_model()
    batches = [ids(4, 16, seed=s) for s in range(2)]
    usage = collect_usage(model, batches)
    layer = model.config.moe_layer_ids[0]
    busiest = int(usage[layer].argmax())
    with torch.no_grad():  # the most routed expert now barely changes the output: REAP should drop it
        model.model.layers[layer].mlp.experts.down_proj[busiest] *= 1e-3
    saliency = collect_saliency(model, batches)
    keep = 4
    pruned, report = prune_experts(model, usage, PruneConfig(keep_experts=keep, criterion="reap"), saliency)
    for i, kept in report.kept.items():
        assert kept == sorted(saliency[i].topk(keep).indices.tolist()), i
    assert busiest not in report.kept[layer]
    _, by_frequency = prune_experts(model, usage, PruneConfig(keep_experts=keep))
    assert busiest in by_frequency.kept[layer]
    assert report.criterion == "reap" and pruned.config.num_experts == keep
    # the pruned model's kept experts are the original ones
    kept = report.kept[layer]
    torch.testing.assert_close(
        pruned.model.layers[layer].mlp.experts.up_proj, model.model.layers[layer].mlp.experts.up_proj[kept]
    )
    with pytest.raises(PruneError, match="saliency"):
        prune_experts(model, usage, PruneConfig(keep_experts=keep, criterion="reap"))


def test_cli_reap_needs_data(tmp_path, capsys):
    from moe_core.cli import main
    from moe_core.data.prepare import PrepareConfig, prepare

    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=300))
    model.save_pretrained(tmp_path / "model")
    assert (
        main(
            [
                "prune",
                str(tmp_path / "model"),
                "--criterion",
                "reap",
                "--keep",
                "4",
                "--out",
                str(tmp_path / "p"),
            ]
        )
        == 2
    )
    assert "--data" in capsys.readouterr().err
    data = prepare(
        PrepareConfig(max_documents=12, vocab_size=300, seq_len=32, num_proc=1, validate=False),
        tmp_path / "data",
    )
    assert (
        main(
            [
                "prune",
                str(tmp_path / "model"),
                "--criterion",
                "reap",
                "--keep",
                "4",
                "--data",
                str(data),
                "--calib-batches",
                "2",
                "--out",
                str(tmp_path / "p"),
            ]
        )
        == 0
    )
    assert MoEForCausalLM.from_pretrained(tmp_path / "p").config.num_experts == 4
