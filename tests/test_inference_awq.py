"""AWQ for experts: the paper's objective on a small layer, coverage of every expert, the CLI's calibration."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_core import MoEForCausalLM, get_config
from moe_core.inference.quantize import (
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    awq_alphas,
    awq_output_error,
    awq_search_scale,
    expert_modules,
    fake_quantize,
    load_quantized,
    quantize_experts,
    save_quantized,
)
from tests.helpers import tiny_mixtral as tiny_model
from tests.helpers import token_ids as ids

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def outlier_layer(seed=0):
    """A layer whose inputs have a few large channels: the case AWQ is built for (Lin et al. 2024, Sec. 3.1)."""
    g = torch.Generator().manual_seed(seed)
    w_OI = torch.randn(32, 64, generator=g) * 0.1
    x_NI = torch.randn(256, 64, generator=g)
    x_NI[:, :4] *= 20.0  # salient channels
    return w_OI, x_NI


def test_awq_search_minimizes_the_papers_objective_and_beats_rtn():
    w, x = outlier_layer()
    config = QuantConfig(bits=4, group_size=16, method="awq")
    s, alpha, errors = awq_search_scale(w, x, config)
    # a slow reference: the objective at each alpha, written out from Eq. 5 with the plain RTN fake-quant
    mean_abs = x.abs().mean(0)
    reference = []
    for a in awq_alphas(config):
        s_a = mean_abs.pow(a).clamp_min(1e-4)
        s_a = s_a / (s_a.max() * s_a.min()).sqrt()
        w_hat = fake_quantize(w * s_a, config) / s_a
        reference.append(float(((x @ w.T - x @ w_hat.T) ** 2).mean()))
    torch.testing.assert_close(torch.tensor(errors), torch.tensor(reference), rtol=1e-4, atol=0)
    assert alpha == awq_alphas(config)[min(range(len(reference)), key=reference.__getitem__)]
    rtn_error = float(((x @ w.T - x @ fake_quantize(w, config).T) ** 2).mean())
    assert awq_output_error(w, x, s, config) == pytest.approx(min(errors))
    assert errors[0] == pytest.approx(rtn_error, rel=1e-5)  # alpha = 0 is RTN
    assert min(errors) < 0.7 * rtn_error  # salient channels protected: clearly better, not just no worse
    assert 0.0 < alpha


def test_awq_experts_match_their_dequantized_reference_and_cover_every_expert():
    model = tiny_model(num_experts=8)
    calibration = [ids(8, 32, seed=s) for s in range(2)]
    before = {n: p.clone() for n, p in model.named_parameters() if ".experts." not in n}
    full = copy.deepcopy(model)
    config = QuantConfig(bits=4, group_size=16, method="awq", min_tokens=64)
    report = quantize_experts(model, config, calibration)

    assert report.experts_quantized == 2 * 8 and not report.experts_rtn_fallback
    for name, counts in report.calibration_tokens.items():
        assert all(c + f >= 64 for c, f in zip(counts, report.forced_tokens[name])), name
        assert len(report.awq_alpha[name]) == 8
    # router, norms, attention and embeddings untouched, in fp32
    after = dict(model.named_parameters())
    assert set(before) == set(after)
    for name, tensor in before.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], tensor), name
    # the fast path equals plain GroupedExperts holding the dequantized weights (codes * scale / s)
    ref = copy.deepcopy(full)
    with torch.no_grad():
        for (_, q), (_, plain) in zip(expert_modules(model), expert_modules(ref)):
            assert isinstance(q, QuantizedExperts)
            for p in q.projections:
                getattr(plain, p).copy_(q.dequantized_stack(p))
        x = ids()
        for impl in ("sorted", "reference", "static"):
            torch.testing.assert_close(
                model(x, expert_impl=impl).logits, ref(x, expert_impl=impl).logits, atol=1e-5, rtol=1e-5
            )
    # (AWQ minimizes each expert's own output error on its calibration inputs, tested above; end to end on
    # an untrained model with Gaussian activations it is about RTN, so no end-to-end inequality is claimed)
    grid = set(awq_alphas(config))
    assert all(a in grid for alphas in report.awq_alpha.values() for pair in alphas for a in pair)


def test_awq_rare_experts_fall_back_and_are_counted():
    model = tiny_model()
    report = quantize_experts(
        model, QuantConfig(bits=4, group_size=16, method="awq", min_tokens=1000), [ids(1, 8)]
    )
    assert len(report.experts_rtn_fallback) == 2 * model.config.num_experts
    assert report.experts_quantized == 2 * model.config.num_experts
    assert "min_tokens" in report.notes[0]
    for _, module in expert_modules(model):  # a fallback is plain RTN: the identity input scale
        assert torch.equal(module.up_proj_in_scale, torch.ones_like(module.up_proj_in_scale))


def test_awq_needs_calibration_and_round_trips_through_disk(tmp_path):
    model = tiny_model()
    with pytest.raises(QuantizationError, match="calibration"):
        quantize_experts(copy.deepcopy(model), QuantConfig(bits=4, group_size=16, method="awq"))
    config = QuantConfig(bits=4, group_size=16, method="awq", min_tokens=8)
    report = quantize_experts(model, config, [ids(4, 16)])
    save_quantized(model, tmp_path, config, report)
    loaded = load_quantized(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, model(ids()).logits)


def test_cli_awq_requires_data_and_calibrates_from_a_prepared_directory(tmp_path, capsys):
    import json

    from moe_core.cli import main
    from moe_core.data.prepare import PrepareConfig, prepare

    data = prepare(
        PrepareConfig(max_documents=12, vocab_size=300, seq_len=32, num_proc=1, validate=False),
        tmp_path / "data",
    )
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny", vocab_size=300))
    model.save_pretrained(tmp_path / "model")
    experts = model.config.num_experts * len(model.config.moe_layer_ids)
    assert (
        main(
            [
                "quantize",
                str(tmp_path / "model"),
                "--method",
                "awq",
                "--bits",
                "4",
                "--out",
                str(tmp_path / "q"),
            ]
        )
        == 2
    )
    assert "--data" in capsys.readouterr().err
    assert (
        main(
            [
                "quantize",
                str(tmp_path / "model"),
                "--method",
                "awq",
                "--bits",
                "4",
                "--group-size",
                "16",
                "--data",
                str(tmp_path / "nowhere"),
                "--out",
                str(tmp_path / "q"),
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "quantize",
                str(tmp_path / "model"),
                "--method",
                "awq",
                "--bits",
                "4",
                "--group-size",
                "16",
                "--data",
                str(data),
                "--calib-batches",
                "2",
                "--out",
                str(tmp_path / "q"),
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["method"] == "awq" and report["experts_quantized"] == experts
    assert sum(map(sum, report["calibration_tokens"].values())) > 0
    assert isinstance(load_quantized(tmp_path / "q").model.layers[0].mlp.experts, QuantizedExperts)
