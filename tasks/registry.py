"""Registry tasks: register a lifecycle's model as a new version (alias ``candidate``), and the promotion
gate that moves ``champion`` to it only when it beats the current champion by the configured margin."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from tasks import tracking

CANDIDATE, CHAMPION = "candidate", "champion"


@task(name="register-model", retries=2, retry_delay_seconds=2)
def register_model(model_uri: str, name: str, metrics: dict[str, float], parent_run_id: str | None) -> str:
    """A new version of ``name`` from ``model_uri``, with its evaluation metrics as version tags."""
    version = tracking.register(model_uri, name, tags={"moe_lab.lifecycle_run_id": parent_run_id or "",
                                                       **{f"metric.{k}": f"{v:.6g}" for k, v in metrics.items()}})
    tracking.set_alias(name, CANDIDATE, version)
    if parent_run_id:
        tracking.set_tags(parent_run_id, {"registry.model": name, "registry.version": version})
    return version


def decide(candidate: float | None, champion: float | None, margin: float, higher_is_better: bool) -> tuple[bool, str]:
    """(promote?, why). Relative margin: lower-is-better needs candidate <= champion * (1 - margin)."""
    if candidate is None:
        return False, "the candidate has no value for the promotion metric"
    if champion is None:
        return True, "no champion yet"
    target = champion * (1 + margin) if higher_is_better else champion * (1 - margin)
    better = candidate >= target if higher_is_better else candidate <= target
    relation = ">=" if higher_is_better else "<="
    verdict = "beats" if better else "does not beat"
    return better, f"candidate {candidate:.6g} {verdict} champion {champion:.6g} by margin {margin:g} (needs {relation} {target:.6g})"


@task(name="promotion-gate", retries=2, retry_delay_seconds=2)
def promote(name: str, version: str, metric: str, margin: float, higher_is_better: bool,
            parent_run_id: str | None) -> dict:
    """Move ``champion`` to ``version`` when it wins; otherwise keep the champion. The decision and its
    reason are recorded on the version, on the lifecycle's MLflow run and as a Prefect artifact."""
    champion = tracking.alias_version(name, CHAMPION)
    candidate_value = _metric(tracking.client().get_model_version(name, version).tags, metric)
    champion_value = _metric(champion.tags, metric) if champion is not None else None
    promoted, reason = decide(candidate_value, champion_value, margin, higher_is_better)
    if champion is not None and str(champion.version) == str(version):
        promoted, reason = True, "already the champion"
    if promoted:
        tracking.set_alias(name, CHAMPION, version)
    decision = {"promoted": promoted, "reason": reason, "version": version,
                "champion": version if promoted else (str(champion.version) if champion else None)}
    tracking.set_version_tags(name, version, {"promotion.decision": "promoted" if promoted else "kept_champion",
                                              "promotion.reason": reason})
    if parent_run_id:
        tracking.set_tags(parent_run_id, {"promotion.decision": "promoted" if promoted else "kept_champion",
                                          "promotion.reason": reason, "registry.champion": decision["champion"]})
    create_markdown_artifact(f"## Promotion gate: {name} v{version}\n\n**{'promoted' if promoted else 'kept champion'}**"
                             f": {reason}\n", key="promotion", description=reason)
    return decision


def _metric(tags: dict[str, str], metric: str) -> float | None:
    value = tags.get(f"metric.{metric}")
    return float(value) if value is not None else None
