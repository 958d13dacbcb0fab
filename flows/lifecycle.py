"""Flow: the whole life of a model in one run: validate, prepare, pretrain (+ the dense baseline with equal
active parameters, unless ``baseline=none``), evaluate, fine-tune (optional, then evaluated again), align (optional:
GRPO or another objective after fine-tuning, then evaluated again), optimize,
register, promote. One MLflow parent run, one nested run per stage. What is registered is the model last evaluated: a stage that changes the model is followed by
an evaluation, and a model with non-finite weights or metrics is never registered."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.common import data_dir_for, link_dashboard, out_dir_for, prepare_config_for, with_data
from flows.params import LifecycleParams
from tasks import data, registry, train
from tasks import evaluate as ev
from tasks import optimize as opt
from tasks.finetune import finetune_model
from tasks.results import ModelResult
from tasks.stages import flow_record, open_journal, record_summary

DEFAULTS = LifecycleParams()  # what the Prefect form shows; flows never modify their parameters


@flow(name="lifecycle")
def lifecycle(params: LifecycleParams = DEFAULTS) -> dict:
    out = out_dir_for("lifecycle", params.out_dir)
    link_dashboard("lifecycle")
    p, t = params, params.train
    journal = open_journal(out)  # where MLflow's records wait while it is unreachable
    with flow_record("lifecycle", params, journal) as run_id:
        validation = data.validate_data(
            t.data.source, "text", p.validation, t.data.max_documents, str(out / "validation"), run_id
        )
        prepare_cfg = prepare_config_for(t, p.validation)
        data_dir = data.prepare_data(prepare_cfg, data_dir_for(prepare_cfg), run_id, validation)
        config = with_data(t, data_dir)

        trained = train.pretrain(
            config, str(out / "pretrain"), run_id, p.nproc, p.subprocess, log_checkpoint=p.log_checkpoint
        )
        models = {"moe": trained.export_dir}
        if p.baseline not in (None, "none"):
            dense = config.model_copy(
                update={"model": config.model.model_copy(update={"baseline": p.baseline})}
            )
            baseline = train.pretrain(
                dense,
                str(out / f"dense-{p.baseline}"),
                run_id,
                p.nproc,
                p.subprocess,
                log_model=False,
                stage=f"pretrain_dense_{p.baseline}",
            )
            models[f"dense-{p.baseline}"] = baseline.export_dir

        evaluation = ev.evaluate_model(models, data_dir, str(out / "eval"), p.evaluate, run_id)
        # the MoE's analysis goes inside its own run directory: it describes that run and no other (the
        # dashboard reads a run's analysis from the run, never from a folder above it, where the dense
        # baseline beside it would find it too)
        analysis_dir = str(out / "pretrain" / "analysis")
        routing = ev.profile_router(trained.export_dir, data_dir, analysis_dir, p.evaluate, run_id)
        cost = ev.cost_report(
            trained.export_dir,
            trained.metrics_path,
            analysis_dir,
            p.evaluate.device_name,
            config.data.seq_len,
            run_id,
        )

        model: ModelResult = trained  # what is registered: the model last evaluated
        first_evaluation = evaluation
        if p.finetune.enabled:
            model = finetune_model(p.finetune.config, trained.export_dir, str(out / "finetune"), run_id)
            evaluation = ev.evaluate_model(
                {"finetuned": model.export_dir},
                data_dir,
                str(out / "eval-finetuned"),
                p.evaluate,
                run_id,
                stage="evaluate_finetuned",
            )

        if p.align.enabled:  # alignment (GRPO, DPO, ...) on the model so far: the fine-tuned one, if any
            model = finetune_model(
                p.align.config, model.export_dir, str(out / "align"), run_id, stage="align"
            )
            evaluation = ev.evaluate_model(
                {"aligned": model.export_dir},
                data_dir,
                str(out / "eval-aligned"),
                p.evaluate.splits,
                p.evaluate.batch_size,
                p.evaluate.max_batches,
                run_id,
                stage="evaluate_aligned",
            )

        refusal = registry.check_model(model.export_dir, evaluation, run_id)  # NaN weights or metrics
        bench = None
        if p.optimize is not None and refusal is None:
            quantized = opt.quantize_model(
                model.export_dir, str(out / "quantized"), p.optimize.quant_config(), run_id, data_dir
            )
            variants = {"pytorch": model.export_dir, "quantized": quantized}
            if p.optimize.onnx:
                variants["onnx"] = opt.export_onnx_model(model.export_dir, str(out / "onnx"), run_id)
            # the evaluation's batches: one perplexity per model and split in the run
            bench = opt.benchmark(
                variants,
                data_dir,
                p.evaluate.max_batches,
                str(out / "benchmark"),
                run_id,
                batch_size=p.evaluate.batch_size,
            )

        headline = record_summary(
            run_id,
            first_evaluation,
            routing,
            cost,
            bench,  # compares in the runs table
            finetuned=evaluation if p.finetune.enabled or p.align.enabled else None,
        )
        version, decision = None, {"promoted": False, "reason": f"not registered: {refusal}"}
        if refusal is None:
            gate = {
                "metric": p.promotion.metric,
                "margin": p.promotion.margin,
                "higher_is_better": p.promotion.higher_is_better,
            }
            version = registry.register_model(
                model.model_uri,
                model.export_dir,
                p.promotion.model_name,
                evaluation,
                run_id,
                model.run_id,
                gate,
            )
            decision = (
                registry.promote(p.promotion.model_name, version, **gate, parent_run_id=run_id)
                if version
                else {"promoted": False, "reason": registry.PENDING_REASON}
            )
    summary = {
        "mlflow_run_id": run_id,
        "model_name": p.promotion.model_name,
        "version": version,
        "promoted": decision["promoted"],
        "reason": decision["reason"],
        "out_dir": str(out),
        "data_dir": data_dir,
        "export_dir": model.export_dir,
        "profile_dir": routing.profile_dir,
        "metrics": evaluation.metrics,
        # what the baseline was trained for: the MoE against it, on the same validation split
        "comparison": {
            "file": str(out / "eval" / "comparison.md"),
            "validation_ppl": {
                name: first_evaluation.metrics.get(
                    "eval.validation_ppl" if i == 0 else f"baseline.{name}.validation_ppl"
                )
                for i, name in enumerate(models)
            },
        },
        "summary_metrics": headline,
        **journal.summary(),
    }
    create_markdown_artifact(_summary_markdown(summary), key="lifecycle-summary", description="where to look")
    return summary


def _summary_markdown(s: dict) -> str:
    return (
        f"## Lifecycle run\n\n| | |\n|---|---|\n| MLflow run | `{s['mlflow_run_id']}` |\n"
        f"| registered model | `{s['model_name']}` version {s['version'] or '(none)'} |\n"
        f"| promotion | {'promoted to champion' if s['promoted'] else 'kept the champion'}: {s['reason']} |\n"
        f"| files | `{s['out_dir']}` |\n| model | `{s['export_dir']}` |\n"
    )
