"""Expert pruning by routing usage, and the on-disk LRU expert cache with graceful degradation."""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.expert_cache import ExpertCacheError, offload_experts
from moe_core.inference.prune import PruneConfig, PruneError, collect_usage, prune_experts, usage_from_profile
from moe_core.mapped import save_streaming

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def model_of(preset="mixtral-tiny", **overrides) -> MoEForCausalLM:
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config(preset, vocab_size=128, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
    return model


def ids(batch=4, seq=16, seed=1):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ pruning
def test_pruning_never_used_experts_changes_nothing():
    model = model_of()
    x = ids()
    with torch.no_grad():  # experts 6, 7 unreachable: their logit is 0 while of each pair (v, -v) among
        for router in model.routers():  # experts 0..5 one is above 0, so 3 experts always beat them (K = 2)
            w = router.gate.weight
            w[1], w[3], w[5] = -w[0], -w[2], -w[4]
            w[6:] = 0.0
    usage = collect_usage(model, [x])
    assert all(int(u[6:].sum()) == 0 for u in usage.values())
    pruned, report = prune_experts(model, usage, PruneConfig())  # min_share 0: drop the never used
    assert pruned.config.num_experts == 6 and report.kept == {0: list(range(6)), 1: list(range(6))}
    assert report.params_after < report.params_before
    with torch.no_grad():  # Mixtral renormalizes the top-k weights: identical outputs
        torch.testing.assert_close(pruned(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)


def test_prune_keeps_the_most_used_and_slices_the_router():
    model = model_of()
    usage = {0: torch.tensor([5, 0, 9, 1, 7, 3, 2, 8]), 1: torch.tensor([1, 1, 1, 1, 9, 9, 9, 9])}
    pruned, report = prune_experts(model, usage, PruneConfig(keep_experts=4))
    assert report.kept == {0: [0, 2, 4, 7], 1: [4, 5, 6, 7]}
    torch.testing.assert_close(
        pruned.model.layers[0].mlp.router.gate.weight,
        model.model.layers[0].mlp.router.gate.weight[[0, 2, 4, 7]],
    )
    torch.testing.assert_close(
        pruned.model.layers[1].mlp.experts.down_proj,
        model.model.layers[1].mlp.experts.down_proj[[4, 5, 6, 7]],
    )
    assert report.usage_share_kept[1] == pytest.approx(36 / 40)


def test_merge_folds_dropped_experts_into_kept_ones():
    model = model_of()
    usage = {0: torch.tensor([9, 9, 9, 9, 1, 1, 1, 1]), 1: torch.tensor([9, 9, 9, 9, 1, 1, 1, 1])}
    pruned, report = prune_experts(model, usage, PruneConfig(keep_experts=4, merge_similar=True))
    assert set(report.merged_into[0]) == {4, 5, 6, 7} and set(report.merged_into[0].values()) <= {0, 1, 2, 3}
    target = report.merged_into[0][4]
    assert not torch.equal(
        pruned.model.layers[0].mlp.experts.up_proj[target], model.model.layers[0].mlp.experts.up_proj[target]
    )


def test_prune_rejects_mismatched_usage():
    model = model_of()
    with pytest.raises(PruneError, match="different model"):
        prune_experts(model, {0: torch.ones(4), 1: torch.ones(4)})
    with pytest.raises(PruneError, match="MoE layers"):
        prune_experts(model, {0: torch.ones(8)})


def test_usage_from_router_profile(tmp_path):
    from moe_core.analytics.profile import collect_profile

    model = model_of()
    profile = collect_profile(model, [ids()])
    profile.to_dir(tmp_path / "profile")
    usage = usage_from_profile(tmp_path / "profile")
    direct = collect_usage(model, [ids()])
    assert {k: v.tolist() for k, v in usage.items()} == {k: v.tolist() for k, v in direct.items()}


# ------------------------------------------------------------------------------------------------ expert cache
@pytest.mark.parametrize("capacity,prefetch", [(3, False), (16, True)])
def test_offloaded_model_equals_full_model(tmp_path, capacity, prefetch):
    full = model_of()
    offloaded = model_of()
    cache = offload_experts(offloaded, tmp_path / "experts", capacity=capacity, prefetch=prefetch)
    assert not any(".experts." in name for name, _ in offloaded.named_parameters())
    x = ids(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(x).logits, full(x).logits, atol=1e-5, rtol=1e-5)
    prompt = x[:1, :5]
    assert torch.equal(
        offloaded.generate(prompt, max_new_tokens=8, do_sample=False),
        full.generate(prompt, max_new_tokens=8, do_sample=False),
    )
    assert len(cache.resident) <= capacity
    assert cache.stats.misses > 0
    if prefetch:  # 16 of the 16 experts fit: everything after the first loads is a hit
        assert cache.stats.prefetched > 0 and cache.stats.hits > 0 and cache.stats.evictions == 0
    else:
        assert cache.stats.evictions > 0


def test_missing_expert_reroutes_with_a_warning_and_generation_continues(tmp_path):
    model = model_of()
    cache = offload_experts(model, tmp_path / "experts", capacity=4)
    x = ids(2, 12)
    with torch.no_grad():
        routing = model_of()(x, output_routing=True).routing
    popular = int(routing[0].tokens_per_expert_E.argmax())
    (tmp_path / "experts" / f"layer0_expert{popular}.safetensors").unlink()
    with pytest.warns(RuntimeWarning, match=f"expert {popular} of layer 0"):
        out = model.generate(x[:1, :6], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 12)
    assert cache.stats.fallbacks > 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per expert, not on every step
        model(x)


def test_a_cache_smaller_than_one_token_needs_warns(tmp_path):
    """mixtral-tiny: 2 MoE layers x top-2 = 4 experts a token; an LRU of 3 evicts each before its next use."""
    with pytest.warns(RuntimeWarning, match="capacity 3 is below the 4 experts one token uses"):
        offload_experts(model_of(), tmp_path / "small", capacity=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload_experts(model_of(), tmp_path / "enough", capacity=4)


def test_cache_errors_clearly(tmp_path):
    model = model_of()
    with pytest.raises(ExpertCacheError, match="capacity"):
        offload_experts(model, tmp_path / "a", capacity=0)
    with pytest.raises(ExpertCacheError, match="write=True"):
        offload_experts(model_of(), tmp_path / "nothing", capacity=2, write=False)


@pytest.mark.parametrize("criterion", ["frequency", "reap"])
def test_a_large_model_directory_is_pruned_from_its_memory_mapping(tmp_path, monkeypatch, criterion):
    """``moe-lab prune`` of the full OLMoE-1B-7B loaded the whole 12.9 GiB model and copied the kept experts
    (a 19.6 GiB peak); a model larger than memory could not be pruned. Above 1 B parameters (here 1,000) a
    model directory stays memory-mapped: the calibration runs on the mapping, the kept experts stay the file's
    tensors and are written a stack at a time. The output is the one pruning the loaded model gives."""
    from safetensors.torch import load_file

    from moe_core import load
    from moe_core.finetune import sizing
    from moe_core.inference import prune as prune_module
    from moe_core.inference.prune import collect_saliency, prune_checkpoint
    from moe_core.mapped import is_file_backed
    from tests.test_mmap_base import write_checkpoint

    source = write_checkpoint(tmp_path / "source", "olmoe", torch.bfloat16)
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    config = PruneConfig(keep_experts=2, criterion=criterion)
    model = load(source).model  # the reference: loaded whole, in its stored bf16
    saliency = collect_saliency(model, batches) if criterion == "reap" else None
    reference, _ = prune_experts(model, collect_usage(model, batches), config, saliency)
    reference.save_pretrained(tmp_path / "reference")

    monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)
    streamed = []
    monkeypatch.setattr(
        prune_module, "save_streaming", lambda *a: streamed.append(a[0]) or save_streaming(*a)
    )
    prune_checkpoint(source, None, tmp_path / "pruned", config, batches)
    (pruned_model,) = streamed  # written from the mapping
    experts = pruned_model.model.layers[0].mlp.experts
    assert experts.num_experts == reference.config.num_experts < model.config.num_experts
    assert is_file_backed(experts.up_proj_0, next(source.glob("*.safetensors")))
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("pruned", "reference"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert (tmp_path / "pruned" / "config.json").read_text() == (
        tmp_path / "reference" / "config.json"
    ).read_text()
