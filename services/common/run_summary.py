"""The summary `riptide up --steps N` prints: what each service did, from its admin state."""

from __future__ import annotations

import json
from typing import Any

from services.common.checkpoint_steps import latest_checkpoint_step
from services.common.status_report import collect


def _get(tree: dict[str, Any], path: str, default: Any = None) -> Any:
    node: Any = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def summarize(config: Any) -> str:
    """A few lines a person reads after a run, then the same figures as one JSON line."""
    report = collect(config)
    trainer = _get(report, "trainer.details", {})
    rollout = _get(report, "rollout.details.scheduler", {})
    router = _get(report, "router.details", {})
    sandbox = _get(report, "sandbox.details", {})
    total_step = trainer.get("total_step_s") or 0.0
    total_wait = trainer.get("total_wait_s") or 0.0
    figures = {
        "steps": trainer.get("step"),
        "checkpoint_step": latest_checkpoint_step(config.trainer.checkpoint.dir),
        "weight_version": trainer.get("weight_version"),
        "groups_trained": trainer.get("num_groups_trained"),
        "reward_mean_last_step": _get(trainer, "last_step.reward_mean"),
        "loss_last_step": _get(trainer, "last_step.loss"),
        "mismatch_kl_last_step": _get(trainer, "last_step.mismatch_kl"),
        "trainer_idle_fraction": round(total_wait / (total_wait + total_step), 3)
        if total_step else None,
        "episodes_finished": sandbox.get("episodes_finished"),
        "groups_written": rollout.get("written_groups"),
        "groups_dropped": rollout.get("dropped_groups"),
        "mean_in_flight": rollout.get("mean_in_flight"),
        "prefix_cache_hit_rate": router.get("hit_rate"),
        "eval_success_by_weight_version": {
            version: e.get("mean_success") for version, e in (rollout.get("eval") or {}).items()},
    }
    lines = ["[up] summary"]
    lines += [f"     {key:<24} {value}" for key, value in figures.items()]
    lines.append(json.dumps({"riptide_up_summary": figures}, default=str))
    return "\n".join(lines)
