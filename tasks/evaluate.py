"""Evaluation tasks over `moe_core.eval` and `moe_core.analytics`: loss/perplexity (with a comparison table
against baselines), the router profile and its plots, and the cost report. Model and data go in as paths."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from moe_core.analytics.cost import cost_report as build_report
from moe_core.analytics.cost import measure_throughput, usage_from_events
from moe_core.analytics.profile import ProfileConfig, profile_split
from moe_core.data.tokenizer import load_tokenizer
from moe_core.eval.compare import compare_models
from moe_core.eval.perplexity import to_markdown
from moe_core.fileio import staged_outputs
from tasks import models_in_memory, tracking
from tasks.results import CostResult, Evaluation, RouterProfile
from tasks.sections import EvaluateParams
from tasks.stages import stage_run


@task(name="evaluate-model", retries=1, retry_delay_seconds=2)
def evaluate_model(
    models: dict[str, str],
    data_dir: str,
    out_dir: str,
    settings: EvaluateParams,
    parent_run_id: str | None,
    stage: str = "evaluate",
) -> Evaluation:
    """Loss and perplexity per split of each model (the first is the candidate, the others baselines) on
    ``settings.splits`` (``batch_size``, at most ``max_batches`` batches each), and
    bits per byte on the raw validation text with each model's own tokenizer (comparable across
    tokenizers; a model without one of its own is read with the data's). Returns the metrics, which text
    and tokenizer the candidate was judged on, and the names of metrics that are not finite (a diverged
    model). Each model is read once per process (`tasks.models_in_memory`): profiling and pricing reuse it."""
    with stage_run(stage, parent_run_id) as run_id:
        comparison = compare_models(
            models,
            data_dir,
            settings.splits,
            settings.batch_size,
            settings.max_batches,
            load=models_in_memory.get,
        )
        if comparison.warning:
            get_run_logger().warning(comparison.warning)
        with staged_outputs(
            out_dir
        ) as stage:  # whole reports or none, beside what the flow's other stages wrote
            written = [Path(out_dir) / path.name for path in comparison.write(stage)]
        tracking.log_metrics(run_id, comparison.metrics)  # finite values only; the others are named in a tag
        nonfinite = comparison.nonfinite
        tracking.set_tags(run_id, {**comparison.judged_on, "eval.nonfinite": ",".join(nonfinite) or None})
        for path in written:
            tracking.log_artifacts(run_id, path, "evaluation")
        create_table_artifact(
            comparison.records(),
            key="evaluation",
            description="loss and perplexity per split (ratios against the first model)",
        )
    return Evaluation(run_id, comparison.metrics, comparison.judged_on, nonfinite)


@task(name="profile-router", retries=1, retry_delay_seconds=2)
def profile_router(
    model_dir: str,
    data_dir: str,
    out_dir: str,
    settings: EvaluateParams,
    parent_run_id: str | None,
    split: str = "validation",
) -> RouterProfile:
    """The router profile on a split (versioned directory; ``settings.batch_size``, at most
    ``profile_batches`` batches), its plots (``settings.plots``), and per-layer summary metrics. Top tokens
    per expert are recorded as ids and counts; their vocabulary pieces only with ``settings.vocab_pieces``."""
    with stage_run("profile", parent_run_id) as run_id:
        model, tokenizer = models_in_memory.get(model_dir).model, load_tokenizer(Path(data_dir) / "tokenizer")
        profile = profile_split(
            model,
            data_dir,
            split,
            settings.batch_size,
            settings.profile_batches,
            profile_config=ProfileConfig(include_vocab_pieces=settings.vocab_pieces),
            tokenizer=tokenizer,
        )
        out = Path(out_dir)
        profile.to_dir(out / "profile")
        summary = profile.summary()
        metrics = {
            f"router.layer_{row['layer']}.{k}": v
            for row in summary.to_dict("records")
            for k, v in row.items()
            if k != "layer"
        }
        metrics["router.dead_experts"] = sum(len(row) for row in summary["dead_experts"])
        tracking.log_metrics(run_id, metrics)
        health = {
            "router.dead_experts": metrics["router.dead_experts"],  # over the layers: the runs table
            "router.max_over_mean": float(summary["max_over_mean"].max()),
            "router.drop_rate": float(summary["drop_rate"].mean()),
            "router.normalized_entropy": float(summary["normalized_entropy"].mean()),
        }
        tracking.log_artifacts(run_id, out / "profile", "routing_profile")
        if settings.plots:
            # lazy: matplotlib and plotly (~2 s), only when plots are asked for
            from moe_core.analytics.plots import portable_copies, render_all

            with staged_outputs(out) as stage:  # the plots appear all at once (the profile is staged too)
                render_all(profile, stage / "plots", model=model, tokenizer=tokenizer)  # opens offline, here
            # MLflow serves each artifact alone: pages that load plotly.js from its CDN, PNGs beside them
            tracking.log_artifacts(run_id, portable_copies(out / "plots", out / "plots-mlflow"), "plots")
        create_markdown_artifact(
            to_markdown(summary.drop(columns=["dead_experts", "rare_experts"])),
            key="router-profile",
            description="router profile, one row per MoE layer",
        )
    return RouterProfile(run_id, str(out / "profile"), health)


@task(name="cost-report", retries=1, retry_delay_seconds=2)
def cost_report(
    model_dir: str,
    events: str | None,
    out_dir: str,
    device_name: str | None,
    seq_len: int,
    parent_run_id: str | None,
) -> CostResult:
    """Forward throughput here and what a token costs, with the training cost to date from its event file."""
    with stage_run("cost", parent_run_id) as run_id:
        model = models_in_memory.get(model_dir).model
        device = device_name or "cpu"
        throughput = measure_throughput(model, batch_size=4, seq_len=seq_len, steps=3)
        training = usage_from_events(events, device) if events and Path(events).is_file() else None
        report = build_report(model.config, throughput.tokens_per_s, device, seq_len, training=training)
        out = Path(out_dir)
        with staged_outputs(out) as stage:  # whole reports or none, beside what the flow's other stages wrote
            (stage / "cost.md").write_text(report.to_markdown() + "\n")
            (stage / "cost.json").write_text(json.dumps(report.to_dict(), indent=1, default=str) + "\n")
        tracking.log_metrics(run_id, tracking.numbers(report.to_dict(), "cost"))
        tracking.log_artifacts(run_id, out / "cost.md", "cost")
        tracking.log_artifacts(run_id, out / "cost.json", "cost")
        create_markdown_artifact(report.to_markdown(), key="cost", description=f"cost per token on {device}")
    headline = {
        "cost.usd_per_million_tokens": report.usd_per_million_tokens,
        "cost.tokens_per_s": throughput.tokens_per_s,
    }
    return CostResult(run_id, report.usd_per_million_tokens, headline)
