"""The LRU expert cache reroutes every kind of unusable expert file to the token's best available expert (by
router score), with a warning and counters, and fails only when a layer has no expert left."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.expert_cache import ExpertCacheError, expert_file, offload_experts

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def setup(tmp_path):
    torch.manual_seed(0)
    full = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=64)).eval()  # 8 experts, top-2
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.2)
    offloaded = copy.deepcopy(full)
    cache = offload_experts(offloaded, tmp_path / "experts", capacity=8)
    x_TD = torch.randn(16, full.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        record = full.model.layers[0].mlp.router(x_TD)
    return full, offloaded, cache, x_TD, record


def rerouted_reference(full, x_TD, record, bad: set[int]) -> torch.Tensor:
    """What layer 0's experts must give: each slot on a bad expert moves to the best-scored expert that is
    neither bad nor already one of the token's choices, keeping its combine weight."""
    ids_TK, dropped_TK = record.expert_ids_TK.clone(), record.dropped_TK.clone()
    for t, k in ((t, k) for t in range(ids_TK.shape[0]) for k in range(ids_TK.shape[1])):
        if int(ids_TK[t, k]) in bad:
            probs_E = record.probs_TE[t].clone()
            probs_E[sorted(bad)] = -1.0
            probs_E[ids_TK[t]] = -1.0
            ids_TK[t, k] = int(probs_E.argmax())
            dropped_TK[t, k] = bool(probs_E.max() < 0)
    moved = dataclasses.replace(record, expert_ids_TK=ids_TK, dropped_TK=dropped_TK)
    with torch.no_grad():
        return full.model.layers[0].mlp.experts.forward_reference(x_TD, moved)


def corrupt(path, kind: str, good: dict[str, torch.Tensor]) -> None:
    if kind == "missing file":
        path.unlink()
    elif kind == "garbage file":
        path.write_bytes(b"\x00\x17not safetensors" * 40)
    elif kind == "wrong shape":
        save_file({**good, "up_proj": good["up_proj"][:-1].contiguous()}, str(path))
    elif kind == "missing key":
        save_file({k: v for k, v in good.items() if k != "down_proj"}, str(path))
    elif kind == "wrong dtype":
        save_file({k: v.half() for k, v in good.items()}, str(path))
    elif kind == "non-finite":
        save_file({**good, "gate_proj": torch.full_like(good["gate_proj"], float("nan"))}, str(path))


def good_tensors(full, expert: int) -> dict[str, torch.Tensor]:
    experts = full.model.layers[0].mlp.experts
    return {p: getattr(experts, p)[expert].detach().clone() for p in ("gate_proj", "up_proj", "down_proj")}


KINDS = ["missing file", "garbage file", "wrong shape", "missing key", "wrong dtype", "non-finite"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_unusable_expert_is_rerouted(tmp_path, kind):
    full, offloaded, cache, x_TD, record = setup(tmp_path)
    bad = int(record.expert_ids_TK[0, 0])  # token 0's first choice
    corrupt(expert_file(tmp_path / "experts", 0, bad), kind, good_tensors(full, bad))
    with pytest.warns(RuntimeWarning, match=f"expert {bad} of layer 0 cannot be used"):
        with torch.no_grad():
            y_TD = offloaded.model.layers[0].mlp.experts(x_TD, record)
    torch.testing.assert_close(y_TD, rerouted_reference(full, x_TD, record, {bad}), atol=1e-5, rtol=1e-5)
    assert cache.stats.unavailable == 1 and cache.stats.fallbacks == int((record.expert_ids_TK == bad).sum())
    assert (0, bad) not in cache.resident


def test_several_top_choices_missing_reroute_to_the_best_available(tmp_path):
    """6 of 8 experts present, and token 0's first and second choices are both gone: generation goes on."""
    full, offloaded, cache, x_TD, record = setup(tmp_path)
    bad = set(record.expert_ids_TK[0].tolist())
    assert len(bad) == 2
    for e in bad:
        expert_file(tmp_path / "experts", 0, e).unlink()
    with pytest.warns(RuntimeWarning):
        with torch.no_grad():
            y_TD = offloaded.model.layers[0].mlp.experts(x_TD, record)
    torch.testing.assert_close(y_TD, rerouted_reference(full, x_TD, record, bad), atol=1e-5, rtol=1e-5)
    assert cache.stats.unavailable == 2
    out = offloaded.generate(
        torch.randint(0, 64, (1, 5)), max_new_tokens=4, min_new_tokens=4, do_sample=False
    )
    assert out.shape == (1, 9)


def test_all_but_one_missing_still_runs_and_none_left_fails(tmp_path):
    full, offloaded, cache, x_TD, record = setup(tmp_path)
    for e in range(1, 8):
        expert_file(tmp_path / "experts", 0, e).unlink()
    with pytest.warns(RuntimeWarning), torch.no_grad():
        y_TD = offloaded.model.layers[0].mlp.experts(x_TD, record)
    torch.testing.assert_close(
        y_TD, rerouted_reference(full, x_TD, record, set(range(1, 8))), atol=1e-5, rtol=1e-5
    )
    expert_file(tmp_path / "experts", 0, 0).write_bytes(b"garbage")
    cache.resident.clear()
    with pytest.warns(RuntimeWarning), pytest.raises(ExpertCacheError, match="no expert of layer 0"):
        with torch.no_grad():
            offloaded.model.layers[0].mlp.experts(x_TD, record)
