"""Registry tasks: register a lifecycle's model as a new version (alias ``candidate``), and the promotion
gate that moves ``champion`` to it only when it beats the current champion by the configured margin.

Two rules keep a broken or mismeasured model out of production:
- a model whose weights or evaluation metrics are not finite is never registered (the refusal and its reason
  are tagged on the lifecycle's run and returned to the flow);
- champion and candidate are compared only on the same evaluation text (its sha256 is a version tag), and a
  per-token metric (loss, perplexity) only with the same tokenizer too; per-byte metrics (``*_bpb``) compare
  across tokenizers. Anything else keeps the champion and records why.
The read-champion / compare / move-alias sequence holds the store lock (`tasks.storelock`), so two
lifecycles finishing together decide one after the other.
"""

from __future__ import annotations

import math

from prefect import task
from prefect.artifacts import create_markdown_artifact

from moe_core.errors import MoELabError
from moe_core.eval.finite import nonfinite_tensors
from tasks import pending, tracking
from tasks.results import Evaluation
from tasks.storelock import store_lock

CANDIDATE, CHAMPION = "candidate", "champion"
TEXT_TAG, TOKENIZER_TAG = "eval.text_sha256", "eval.tokenizer_sha256"
PENDING_REASON = (
    "pending: MLflow is unreachable; `moe-lab sync` on the flow's directory registers the model "
    "and runs the promotion gate"
)


class UnregistrableModel(MoELabError):
    """A model with non-finite weights or evaluation metrics was about to be registered."""


def registration_refusal(model_dir: str, evaluation: Evaluation) -> str | None:
    """Why ``model_dir`` must not be registered (non-finite weights or metrics), or None."""
    bad = nonfinite_tensors(model_dir)
    if bad:
        names = ", ".join(list(bad)[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return f"non-finite weights: {sum(bad.values())} NaN/inf values in {len(bad)} tensors ({names})"
    nonfinite = [k for k, v in evaluation.metrics.items() if not math.isfinite(v)]
    if nonfinite:
        return f"non-finite evaluation: {', '.join(nonfinite[:5])}"
    return None


@task(name="check-model", retries=1, retry_delay_seconds=2)
def check_model(model_dir: str, evaluation: Evaluation, parent_run_id: str | None) -> str | None:
    """None when ``model_dir`` may be registered, else why not (also tagged on the lifecycle's run as
    ``registry.decision=refused`` / ``registry.reason`` and shown as a Prefect artifact)."""
    refusal = registration_refusal(model_dir, evaluation)
    if refusal is not None:
        if parent_run_id:
            tracking.set_tags(parent_run_id, {"registry.decision": "refused", "registry.reason": refusal})
        create_markdown_artifact(
            f"## Registry\n\n**not registered**: {refusal}\n", key="registry", description=refusal
        )
    return refusal


@task(name="register-model", retries=2, retry_delay_seconds=2)
def register_model(
    model_uri: str | None,
    model_dir: str,
    name: str,
    evaluation: Evaluation,
    parent_run_id: str | None,
    model_run_id: str | None = None,
    gate_settings: dict | None = None,
) -> str | None:
    """A new version of ``name`` from ``model_uri`` (the model in ``model_dir``, logged by run
    ``model_run_id``), tagged with its evaluation: metrics, and the text and tokenizer it was judged on.
    Refuses (`UnregistrableModel`) a model that `check_model` would refuse. While MLflow is unreachable
    returns None: the registration (and, with ``gate_settings``, the promotion gate) waits in the pending
    manifest for ``moe-lab sync``."""
    refusal = registration_refusal(model_dir, evaluation)
    if refusal is not None:
        raise UnregistrableModel(f"{model_dir}: {refusal}")
    tags = {
        "moe_lab.lifecycle_run_id": parent_run_id or "",
        **evaluation.judged_on,
        **{f"metric.{k}": f"{v:.6g}" for k, v in evaluation.metrics.items()},
    }
    later = {
        "model_uri": model_uri,
        "model_run": model_run_id,
        "name": name,
        "tags": tags,
        "gate": gate_settings,
    }
    journal = pending.current()
    if journal.offline(parent_run_id) or model_uri is None:
        if model_uri is None and journal.offline_reason is None:
            raise UnregistrableModel(f"{model_dir}: no model was logged to MLflow, nothing to register")
        journal.record("register", parent_run_id, **later)
        return None
    try:
        version = tracking.register(model_uri, name, tags=tags)
    except Exception:
        if (reason := tracking.probe()) is None:
            raise
        journal.go_offline(reason)
        journal.record("register", parent_run_id, **later)
        return None
    return record_registration(name, version, parent_run_id)


def record_registration(name: str, version: str, parent_run_id: str | None) -> str:
    tracking.set_alias(name, CANDIDATE, version)
    if parent_run_id:
        tracking.set_tags(
            parent_run_id,
            {"registry.decision": "registered", "registry.model": name, "registry.version": version},
        )
    return version


def decide(
    candidate: float | None, champion: float | None, margin: float, higher_is_better: bool
) -> tuple[bool, str]:
    """(promote?, why). Relative margin: lower-is-better needs candidate <= champion * (1 - margin)."""
    if candidate is None or not math.isfinite(candidate):
        return False, f"the candidate has no finite value for the promotion metric ({candidate})"
    if champion is None:
        return True, "no champion yet"
    target = champion * (1 + margin) if higher_is_better else champion * (1 - margin)
    better = candidate >= target if higher_is_better else candidate <= target
    relation = ">=" if higher_is_better else "<="
    verdict = "beats" if better else "does not beat"
    return (
        better,
        f"candidate {candidate:.6g} {verdict} champion {champion:.6g} by margin {margin:g} (needs {relation} {target:.6g})",
    )


def incomparable(candidate_tags: dict[str, str], champion_tags: dict[str, str], metric: str) -> str | None:
    """Why the two versions' ``metric`` values cannot be compared, or None when they can."""

    def differs(tag: str) -> bool:
        return not candidate_tags.get(tag) or candidate_tags.get(tag) != champion_tags.get(tag)

    if differs(TEXT_TAG):
        return (
            f"not comparable: the champion was evaluated on other text ({TEXT_TAG} "
            f"{champion_tags.get(TEXT_TAG, 'missing')[:12]} vs {candidate_tags.get(TEXT_TAG, 'missing')[:12]}); "
            "evaluate both on the same data"
        )
    if not metric.endswith("_bpb") and differs(TOKENIZER_TAG):
        return (
            f"not comparable: {metric} is per token and the tokenizers differ; "
            "promote on a per-byte metric (eval.validation_bpb)"
        )
    return None


def gate(name: str, version: str, metric: str, margin: float, higher_is_better: bool) -> dict:
    """The promotion decision, under the store lock: read the champion, compare, move the alias, tag."""
    with store_lock(tracking.tracking_uri(), f"promotion gate of {name}"):
        champion = tracking.alias_version(name, CHAMPION)
        candidate_tags = tracking.client().get_model_version(name, version).tags
        candidate_value = _metric(candidate_tags, metric)
        if champion is not None and str(champion.version) == str(version):
            promoted, reason = True, "already the champion"
        elif champion is not None and (why := incomparable(candidate_tags, champion.tags, metric)):
            promoted, reason = False, why
        else:
            champion_value = _metric(champion.tags, metric) if champion is not None else None
            promoted, reason = decide(candidate_value, champion_value, margin, higher_is_better)
        if promoted:
            tracking.set_alias(name, CHAMPION, version)
        tracking.set_version_tags(
            name,
            version,
            {"promotion.decision": "promoted" if promoted else "kept_champion", "promotion.reason": reason},
        )
    return {
        "promoted": promoted,
        "reason": reason,
        "version": version,
        "champion": version if promoted else (str(champion.version) if champion else None),
    }


@task(name="promotion-gate", retries=2, retry_delay_seconds=2)
def promote(
    name: str, version: str, metric: str, margin: float, higher_is_better: bool, parent_run_id: str | None
) -> dict:
    """Move ``champion`` to ``version`` when it wins; otherwise keep the champion. The decision and its
    reason are recorded on the version, on the lifecycle's MLflow run and as a Prefect artifact."""
    journal = pending.current()
    try:
        if journal.offline_reason is not None:
            raise ConnectionError(journal.offline_reason)
        decision = gate(name, version, metric, margin, higher_is_better)
    except Exception:
        if (offline := journal.offline_reason or tracking.probe()) is None:
            raise
        journal.go_offline(offline)
        journal.record(
            "promote",
            parent_run_id,
            name=name,
            version=version,
            gate={"metric": metric, "margin": margin, "higher_is_better": higher_is_better},
        )
        return {"promoted": False, "version": version, "champion": None, "reason": PENDING_REASON}
    record_decision(decision, parent_run_id)
    promoted, reason = decision["promoted"], decision["reason"]
    create_markdown_artifact(
        f"## Promotion gate: {name} v{version}\n\n**{'promoted' if promoted else 'kept champion'}**"
        f": {reason}\n",
        key="promotion",
        description=reason,
    )
    return decision


def record_decision(decision: dict, parent_run_id: str | None) -> None:
    promoted, reason = decision["promoted"], decision["reason"]
    if parent_run_id:
        tracking.set_tags(
            parent_run_id,
            {
                "promotion.decision": "promoted" if promoted else "kept_champion",
                "promotion.reason": reason,
                "registry.champion": decision["champion"],
            },
        )


def _metric(tags: dict[str, str], metric: str) -> float | None:
    value = tags.get(f"metric.{metric}")
    return float(value) if value is not None else None
