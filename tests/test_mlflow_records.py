"""MLflow records people can read: the experiment opens on its runs, the architecture is in the params,
plots render where MLflow serves them (no relative script), and one perplexity per model and split."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_experiment_opens_on_runs_and_runs_carry_the_architecture(sqlite_store):
    from mlflow import MlflowClient

    from tasks import tracking

    new = tracking.experiment_id("fresh")
    assert MlflowClient().get_experiment(new).tags["mlflow.experimentKind"] == "custom_model_development"
    old = MlflowClient().create_experiment("made-by-an-earlier-version")
    assert "mlflow.experimentKind" not in MlflowClient().get_experiment(old).tags
    assert tracking.experiment_id("made-by-an-earlier-version") == old
    assert MlflowClient().get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"

    # the architecture as params (one store for both checks: creating a SQLite store takes seconds)
    from moe_core import get_config
    from moe_core.config import parameter_counts
    from tasks import tracking

    config = get_config("mixtral-tiny")
    run = tracking.start_run("pretrain")
    tracking.log_architecture(run, config)
    params = MlflowClient().get_run(run).data.params
    counts = parameter_counts(config)
    assert params["arch.num_experts"] == str(config.num_experts) and params["arch.top_k"] == str(
        config.num_experts_per_tok
    )
    assert params["arch.hidden_size"] == str(config.hidden_size)
    assert params["arch.num_layers"] == str(config.num_hidden_layers)
    assert params["arch.params_total"] == str(counts["total"]) and params["arch.params_active"] == str(
        counts["active"]
    )
    assert int(params["arch.params_active"]) < int(params["arch.params_total"])
    assert params["arch.router"].startswith(config.router)
    # the link the lab prints opens MLflow 3's "Model training" view: the experiment tag alone did not in
    # MLflow 3.17 (a fresh browser landed on the GenAI traces overview)
    assert tracking.run_url(run).endswith(f"/runs/{run}?workflowType=machine_learning")


def test_mlflow_plot_copies_have_no_relative_script_and_stay_small(tmp_path):
    from moe_core import MoEForCausalLM, get_config
    from moe_core.analytics.plots import Plot, plot_expert_load, portable_copies
    from moe_core.analytics.profile import collect_profile

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    profile = collect_profile(model, [ids])
    inline = plot_expert_load(profile)  # no out_dir: a figure for the notebook, nothing written
    assert isinstance(inline, Plot) and len(inline) == 0 and inline._repr_png_().startswith(b"\x89PNG")
    saved = plot_expert_load(profile, tmp_path / "plots")
    assert saved["png"].is_file() and saved["html"].is_file()
    assert 'src="plotly.min.js"' in saved["html"].read_text()  # the local copy opens offline

    copies = portable_copies(tmp_path / "plots", tmp_path / "mlflow")
    assert not (copies / "plotly.min.js").exists()
    html = (copies / "expert_load.html").read_text()
    sources = re.findall(r'<script[^>]*\ssrc="([^"]+)"', html)
    assert sources and all(s.startswith("https://") for s in sources), (
        sources
    )  # MLflow serves no sibling files
    assert len(html.encode()) < 200_000  # not the 4.8 MB plotly.js inlined
    assert (copies / "expert_load.png").read_bytes() == saved["png"].read_bytes()


def test_benchmark_and_evaluation_give_one_perplexity(tmp_path):
    from moe_core import MoEForCausalLM, get_config
    from moe_core.data import prepare
    from moe_core.eval.batches import split_batches
    from moe_core.eval.perplexity import evaluate_splits
    from moe_core.inference.evaluate import compare_variants, perplexity

    data = prepare.prepare(
        prepare.PrepareConfig(max_documents=30, vocab_size=300, seq_len=32, validate=False), tmp_path / "data"
    )
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("switch-tiny", vocab_size=300, capacity_factor=1.0)).eval()
    model.save_pretrained(tmp_path / "model")
    evaluated = evaluate_splits(model, data, ["validation"], batch_size=3, max_batches=2)["validation"]
    assert perplexity(model, split_batches(data, "validation", 3, 2)) == pytest.approx(
        evaluated.perplexity, rel=1e-6
    )
    rows = compare_variants({"pytorch": str(tmp_path / "model")}, data, batches=2, batch_size=3)
    assert rows[0]["perplexity"] == pytest.approx(evaluated.perplexity, rel=1e-5)


def test_rich_notebook_representations(tmp_path):
    from moe_core import MoEForCausalLM, get_config
    from moe_core.analytics.cost import cost_report
    from moe_core.analytics.profile import collect_profile
    from moe_core.eval.perplexity import evaluate_loss

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    profile_html = collect_profile(model, [ids])._repr_html_()
    assert "<table" in profile_html and "Router profile" in profile_html and "max_over_mean" in profile_html
    loss_md = evaluate_loss(model, [ids], split="validation")._repr_markdown_()
    assert loss_md.startswith("**validation**: perplexity") and "64 predicted" not in loss_md
    assert "30 predicted tokens" in loss_md  # 2 rows x 15 next-token targets
    cost_md = cost_report(model.config, 1000.0, "cpu", 16)._repr_markdown_()
    assert "USD per 1M tokens" in cost_md and cost_md.count("|") > 10
