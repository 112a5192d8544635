"""Advisories in words: what looks wrong in the run, each judged against a threshold of
`rollout.dashboard.advisories` (config.py) that the message names."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from services.rollout.dashboard.config import AdvisoryConfig
from services.rollout.dashboard.load import engine_totals
from services.rollout.dashboard.record import Event, RunRecord
from services.rollout.dashboard.timeline import TRAINER_PHASES, trainer_idle_fraction
from services.rollout.dashboard.training import DROP_KINDS

Advisory = dict[str, str]
NO_VERDICT = (None, "", "unspecified", "no_verdict")


def _advice(code: str, message: str, threshold: str) -> Advisory:
    return {"code": code, "message": message, "threshold": f"rollout.dashboard.advisories."
                                                            f"{threshold}"}


def _recent_loads(record: RunRecord, cfg: AdvisoryConfig) -> list[Event]:
    since = record.now - cfg.window_s
    return [e for e in record.of_kind("rollout.load") if e.start >= since]


def _episodes(record: RunRecord) -> list[dict[str, Any]]:
    return [e.attrs for e in record.of_kind("rollout.episode") if not e.attrs.get("eval")]


def low_concurrency(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    loads = _recent_loads(record, cfg)
    if len(loads) < cfg.min_samples:
        return []
    median = statistics.median(e.attrs.get("in_flight", 0) for e in loads)
    cap = loads[-1].attrs.get("cap") or 0
    if cap and median < cfg.min_concurrency_fraction * cap:
        return [_advice("low_concurrency",
                        f"samples in flight are well below the cap: median {median:g} of "
                        f"{cap} over the last {cfg.window_s:g} s (below "
                        f"{cfg.min_concurrency_fraction:.0%}); admission is held back "
                        "(staleness gate, queued groups, unready engines) or episodes are slow "
                        "to start", "min_concurrency_fraction")]
    return []


def imbalance(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    loads = _recent_loads(record, cfg)
    if len(loads) < cfg.min_samples:
        return []
    engines: dict[str, list[float]] = defaultdict(list)
    ranks: dict[str, list[float]] = defaultdict(list)
    for e in loads:
        per_engine: dict[str, float] = defaultdict(float)
        for r in e.attrs.get("engines", []):
            per_engine[str(r.get("engine"))] += r.get("running", 0)
            ranks[f"{r.get('dp_rank', 0)} of engine {r.get('engine')}"].append(r.get("running", 0))
        for name, running in per_engine.items():
            engines[name].append(running)
    return _out_of_balance("engine", engines, cfg) + _out_of_balance("dp rank", ranks, cfg)


def _out_of_balance(what: str, series: dict[str, list[float]],
                    cfg: AdvisoryConfig) -> list[Advisory]:
    """The one member furthest from the mean of the others, when past the ratio bound."""
    means = {name: statistics.fmean(values) for name, values in series.items()}
    worst: tuple[float, str, float, float] | None = None
    for name, mean in means.items():
        others = [m for n, m in means.items() if n != name]
        rest = statistics.fmean(others) if others else mean
        if max(mean, rest) < cfg.min_running_for_imbalance:
            continue
        ratio = max(mean, rest) / max(min(mean, rest), 1e-9)
        if ratio > cfg.imbalance_ratio and (worst is None or ratio > worst[0]):
            worst = (ratio, name, mean, rest)
    if worst is None:
        return []
    _, name, mean, rest = worst
    word = "busier" if mean > rest else "idler"
    return [_advice(f"{what.replace(' ', '_')}_imbalance",
                    f"{what} {name} is much {word} than the others: {mean:.1f} running "
                    f"requests on average vs {rest:.1f} (ratio bound {cfg.imbalance_ratio:g}); "
                    "check the router's policy and that engine's health", "imbalance_ratio")]


def low_cache_hits(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    loads = _recent_loads(record, cfg)
    if len(loads) < 2:
        return []
    first, last = engine_totals(loads[0]), engine_totals(loads[-1])
    found = []
    for name, (cached, prompt) in sorted(last.items()):
        old_cached, old_prompt = first.get(name, (0.0, 0.0))
        seen = prompt - old_prompt
        if seen >= cfg.min_prompt_tokens_for_cache:
            rate = (cached - old_cached) / seen
            if rate < cfg.min_cache_hit_rate:
                found.append(_advice("low_cache_hit_rate",
                                     f"engine {name} reuses little of its prefix cache: {rate:.0%}"
                                     f" of prompt tokens over the last {cfg.window_s:g} s (below "
                                     f"{cfg.min_cache_hit_rate:.0%}); turns of one episode may "
                                     "land on different engines, or the cache is too small",
                                     "min_cache_hit_rate"))
    return found


def stalls(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    """A phase open (or the newest of its kind, just ended) far longer than the median of its
    kind, or a trainer that has ended no phase for far longer than its usual cycle."""
    finished: dict[str, list[float]] = defaultdict(list)
    for e in record.events:
        if e.end is not None and e.end > e.start:
            finished[e.kind].append(e.end - e.start)
    now, found = record.now, []
    for e in record.events:
        if e.end is None:
            found += _too_long(e.kind, e.id, now - e.start, finished.get(e.kind, []), cfg,
                               "has been open")
    for kind in (*TRAINER_PHASES, "rollout.engine_pause", "rollout.eval"):
        took = [(e.id, e.end - e.start) for e in record.of_kind(kind) if e.end is not None]
        if took:
            found += _too_long(kind, took[-1][0], took[-1][1], [d for _, d in took[:-1]], cfg,
                               "took")
    return found + _trainer_silent(record, cfg)


def _too_long(kind: str, ident: str, seconds: float, history: list[float],
              cfg: AdvisoryConfig, verb: str) -> list[Advisory]:
    if len(history) < cfg.stall_min_history:
        return []
    median = statistics.median(history)
    if seconds >= cfg.stall_min_s and seconds > cfg.stall_factor * median:
        return [_advice("stall", f"{kind} {ident} {verb} {seconds:.0f} s, "
                                 f"{seconds / max(median, 1e-9):.0f}x its median of "
                                 f"{median:.1f} s (bound {cfg.stall_factor:g}x): it may be "
                                 "stuck", "stall_factor")]
    return []


def _trainer_silent(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    ends = sorted(e.end for e in record.of_kind("trainer.step") if e.end is not None)
    phases = [e.end for e in record.of_kind(*TRAINER_PHASES) if e.end is not None]
    if len(ends) <= cfg.stall_min_history or not phases:
        return []
    cycle = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
    quiet = record.now - max(phases)
    if quiet >= cfg.stall_min_s and quiet > cfg.stall_factor * cycle:
        return [_advice("stall", f"the trainer has ended no phase for {quiet:.0f} s while a "
                                 f"step takes {cycle:.1f} s (bound {cfg.stall_factor:g}x): it "
                                 "may be stuck in a step, checkpoint or weight sync",
                        "stall_factor")]
    return []


def _fraction(record: RunRecord, cfg: AdvisoryConfig, code: str, threshold: str,
              bound: float, test: Callable[[dict[str, Any]], bool], words: str) -> list[Advisory]:
    episodes = _episodes(record)
    if len(episodes) < cfg.min_samples:
        return []
    share = sum(1 for e in episodes if test(e)) / len(episodes)
    if share > bound:
        return [_advice(code, f"{share:.0%} of {len(episodes)} episodes {words} (at most "
                              f"{bound:.0%})", threshold)]
    return []


def no_verdicts(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    return _fraction(record, cfg, "no_verdict", "max_no_verdict_fraction",
                     cfg.max_no_verdict_fraction, lambda e: e.get("verdict") in NO_VERDICT,
                     "ended without a verdict: no sample is made of them; check the tasks' "
                     "tests and the sandbox's logs")


def truncations(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    return _fraction(record, cfg, "truncated", "max_truncated_fraction",
                     cfg.max_truncated_fraction, lambda e: bool(e.get("truncated")),
                     "were cut short (context length, turn or wall-time limit); raise "
                     "max_context_tokens, max_turns or wall_time_s")


def aborts(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    return _fraction(record, cfg, "aborted", "max_abort_fraction", cfg.max_abort_fraction,
                     lambda e: bool(e.get("aborted")),
                     "were aborted (engine pauses in abort mode, engine or sandbox faults)")


def zero_variance(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    rewards: dict[str, list[float]] = defaultdict(list)
    for e in _episodes(record):
        if isinstance(e.get("reward"), int | float):  # no verdict, no reward
            rewards[str(e.get("group_id"))].append(e["reward"])
    groups = [r for r in rewards.values() if len(r) >= 2]
    if sum(len(r) for r in groups) < cfg.min_samples:
        return []
    flat = sum(1 for r in groups if max(r) == min(r)) / len(groups)
    if flat > cfg.max_zero_variance_fraction:
        return [_advice("zero_variance", f"{flat:.0%} of {len(groups)} groups scored the same "
                                         "on every sample (at most "
                                         f"{cfg.max_zero_variance_fraction:.0%}): their "
                                         "advantages are 0 and they teach nothing; the tasks are "
                                         "too easy or too hard for the model", 
                        "max_zero_variance_fraction")]
    return []


def stale_length_bias(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    stale = {str(e.attrs.get("group_id") or e.id) for e in record.of_kind(*DROP_KINDS)
             if "stale" in str(e.attrs.get("reason", ""))}
    episodes = _episodes(record)
    groups = {str(e.get("group_id")) for e in episodes}
    if len(episodes) < cfg.min_samples or not groups or (
            len(stale) / len(groups) < cfg.min_stale_drop_fraction):
        return []
    dropped = [e.get("response_tokens") or 0 for e in episodes if str(e.get("group_id")) in stale]
    kept = [e.get("response_tokens") or 0 for e in episodes
            if str(e.get("group_id")) not in stale]
    if not dropped or not kept or not statistics.fmean(kept):
        return []
    ratio = statistics.fmean(dropped) / statistics.fmean(kept)
    if ratio > cfg.stale_length_bias:
        return [_advice("stale_length_bias",
                        f"{len(stale)} groups were dropped as stale and their episodes are "
                        f"{ratio:.1f}x longer than the consumed ones (bound "
                        f"{cfg.stale_length_bias:g}x): training is biased toward short "
                        "episodes; raise max_staleness or lower max_concurrent_samples",
                        "stale_length_bias")]
    return []


def trainer_idle(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    idle = trainer_idle_fraction(record)
    if idle is not None and len(record.of_kind("trainer.step")) >= 2 and (
            idle > cfg.max_trainer_idle_fraction):
        return [_advice("trainer_idle", f"the trainer waited for data {idle:.0%} of its time "
                                        f"(at most {cfg.max_trainer_idle_fraction:.0%}): "
                                        "generation is the bottleneck; add engines or raise "
                                        "max_concurrent_samples", "max_trainer_idle_fraction")]
    return []


def no_load_signal(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    """Engines the router, in the newest load reading of the window, reports without a load
    signal: min_load sees only the router's own in-flight calls there."""
    loads = _recent_loads(record, cfg)
    if not loads:
        return []
    silent = sorted({str(r.get("engine")) for r in loads[-1].attrs.get("engines", [])
                     if r.get("load_signal") == "missing"})
    if not silent:
        return []
    return [_advice("no_load_signal",
                    f"the router gets no load signal from {len(silent)} engine(s): "
                    f"{', '.join(silent[:4])}{' ...' if len(silent) > 4 else ''}; neither "
                    "/v1/loads nor /get_load answers, so it balances them by its own in-flight "
                    "calls alone (queues and KV use it cannot see); check the engines' "
                    "version and the router's log", "window_s")]


RULES = (low_concurrency, imbalance, low_cache_hits, stalls, no_verdicts, zero_variance,
         truncations, aborts, stale_length_bias, trainer_idle, no_load_signal)


def advise(record: RunRecord, cfg: AdvisoryConfig) -> list[Advisory]:
    """Every advisory that applies to the run now."""
    return [advice for rule in RULES for advice in rule(record, cfg)]
