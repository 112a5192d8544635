"""The [rollout.dashboard] section: how the dashboard reads the run and when it speaks up."""

from __future__ import annotations

from pydantic import Field

from services.common.config import StrictModel


class AdvisoryConfig(StrictModel):
    """The threshold of every advisory (services/rollout/dashboard/advisories.py)."""

    window_s: float = Field(
        60.0, gt=0, le=86_400,
        description="recent window (seconds) the load, cache and concurrency advisories judge")
    min_samples: int = Field(
        20, ge=1, le=1_000_000,
        description="episodes (or load readings) needed before a ratio advisory may speak")
    min_concurrency_fraction: float = Field(
        0.5, ge=0, le=1,
        description="median samples in flight in the window below this fraction of the cap")
    imbalance_ratio: float = Field(
        2.0, gt=1, le=1000,
        description="an engine or dp rank whose mean running requests is this many times the "
        "mean of the others (or that fraction of it) is out of balance")
    min_running_for_imbalance: float = Field(
        1.0, ge=0, le=1_000_000,
        description="mean running requests per engine below which balance is not judged")
    min_cache_hit_rate: float = Field(
        0.3, ge=0, le=1, description="windowed prefix-cache hit rate of an engine below this")
    min_prompt_tokens_for_cache: int = Field(
        1000, ge=1, le=1 << 40,
        description="prompt tokens an engine must have seen in the window to judge its hit rate")
    stall_factor: float = Field(
        5.0, gt=1, le=1000,
        description="a phase open this many times longer than the median of its kind stalls")
    stall_min_s: float = Field(
        30.0, ge=0, le=86_400, description="and at least this long (seconds)")
    stall_min_history: int = Field(
        3, ge=1, le=10_000, description="finished phases of a kind needed for its median")
    max_no_verdict_fraction: float = Field(
        0.05, ge=0, le=1, description="episodes that ended without a verdict, at most")
    max_zero_variance_fraction: float = Field(
        0.5, ge=0, le=1, description="groups whose samples all scored the same, at most")
    max_truncated_fraction: float = Field(
        0.2, ge=0, le=1,
        description="episodes cut short by the context, turn or wall-time limit, at most")
    max_abort_fraction: float = Field(
        0.03, ge=0, le=1, description="episodes aborted (engine pause, fault), at most")
    min_stale_drop_fraction: float = Field(
        0.05, ge=0, le=1,
        description="groups dropped as stale, as a fraction of all groups, before their "
        "length bias is judged")
    stale_length_bias: float = Field(
        1.5, gt=1, le=1000,
        description="stale-dropped episodes this many times longer (response tokens) than "
        "consumed ones bias training toward short episodes")
    max_trainer_idle_fraction: float = Field(
        0.5, ge=0, le=1, description="fraction of the trainer's time spent waiting for data")


class DashboardConfig(StrictModel):
    """The dashboard page served at /dashboard by the rollout service's admin app."""

    enabled: bool = Field(True, description="serve /dashboard and /dashboard/api")
    poll_interval_ms: int = Field(
        2000, ge=200, le=600_000, description="how often the page asks for fresh data")
    max_events: int = Field(
        200_000, ge=100, le=10_000_000,
        description="newest events kept in memory for the panels (older ones are forgotten)")
    num_recent_samples: int = Field(
        200, ge=1, le=100_000, description="newest episodes listed in the sample table")
    advisories: AdvisoryConfig = Field(
        default_factory=AdvisoryConfig, description="thresholds of the advisories")


def dashboard_url(host: str, port: int, token: str) -> str:
    """The page's address; the token rides in the fragment, which browsers never send."""
    return f"http://{host}:{port}/dashboard#token={token}"
