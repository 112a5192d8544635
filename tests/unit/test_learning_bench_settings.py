"""bench/learning.py's settings: each device's defaults (a flag overrides them), and the GPU
run's config: colocated weight sync, the engine on the GPU with every episode in one batch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("learning_bench", REPO / "bench" / "learning.py")
assert _spec is not None and _spec.loader is not None
learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning)


def test_each_device_has_its_defaults_and_flags_override_them() -> None:
    gpu = learning.parse_args(["--device", "cuda"])
    assert (gpu.steps, gpu.in_flight, gpu.groups_per_step, gpu.eval_samples) == (100, 128, 2, 4)
    assert (gpu.recompute, gpu.optimizer_on_disk, gpu.dtype) == (False, False, "bfloat16")
    assert (gpu.max_staleness, gpu.eval_interval) == (4, 25)
    cpu = learning.parse_args([])
    assert (cpu.steps, cpu.in_flight, cpu.groups_per_step, cpu.eval_samples) == (40, 16, 1, 0)
    assert (cpu.max_staleness, cpu.eval_interval) == (2, 10)
    assert cpu.recompute == cpu.optimizer_on_disk == learning._low_memory()
    flags = learning.parse_args(["--device", "cuda", "--in-flight", "64", "--recompute",
                                 "--max-staleness", "6", "--dtype", "float32"])
    assert (flags.in_flight, flags.recompute, flags.max_staleness, flags.dtype) == (
        64, True, 6, "float32")


def test_the_gpu_run_is_colocated_with_the_engine_on_the_gpu(tmp_path: Path) -> None:
    args = learning.parse_args(["--device", "cuda", "--max-staleness", "3"])
    config = learning._config(tmp_path, tmp_path / "model", args)
    assert config.trainer.weight_sync.mode == "colocated"
    assert config.trainer.weight_sync.bucket_size_mb == 2048.0  # one bucket for a small model
    engine_args = list(config.rollout.fleet.builtin_args)
    assert engine_args[engine_args.index("--device") + 1] == "cuda"
    assert engine_args[engine_args.index("--max-running-requests") + 1] == "128"
    assert config.rollout.scheduler.max_staleness == 3
    assert config.rollout.scheduler.max_concurrent_samples == 128
    assert config.trainer.model.recompute_granularity == "none"
    cpu = learning._config(tmp_path / "cpu", tmp_path / "model",
                           learning.parse_args(["--recompute", "--optimizer-on-disk"]))
    assert cpu.trainer.weight_sync.mode == "rollout"
    assert cpu.trainer.model.recompute_granularity == "full"
    assert cpu.trainer.optimizer.stream_optimizer_state_to_disk == str(
        tmp_path / "cpu" / "adam-state")


def test_the_cpu_run_saves_memory_only_where_the_machine_is_short_of_it(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert not learning._low_memory(meminfo)
    meminfo.write_text("MemTotal:        8000000 kB\nMemAvailable:    6000000 kB\n")
    assert learning._low_memory(meminfo)
    meminfo.write_text("MemTotal:        8000000 kB\n")
    assert learning._low_memory(meminfo)  # unknown: the frugal settings
    assert learning._low_memory(tmp_path / "missing")


def test_the_engine_generation_counter_is_summed_over_its_ranks() -> None:
    """Engine tokens/s comes from the engine's own /metrics counter, every dp rank's sample."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    tokens = Counter("sglang:generation_tokens", "tokens generated", ["dp_rank"],
                     registry=registry)
    tokens.labels("0").inc(120)
    tokens.labels("1").inc(30)
    body = generate_latest(registry)

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        counters = learning._engine_counters(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert counters == {"sglang:generation_tokens_total": 150.0}
    assert learning._engine_counters(None) == {}


def test_episode_seconds_are_medians_over_the_training_episodes() -> None:
    from services.common.events import Event

    def episode(total: float, evaluation: bool = False) -> Event:
        return Event.model_validate({
            "kind": "rollout.episode", "service": "rollout", "start": 0.0, "end": total,
            "id": "s", "attrs": {"eval": evaluation, "seconds": {
                "generate": total / 2, "commands": 1.0, "total": total}}})

    events = [episode(2.0), episode(4.0), episode(9.0), episode(100.0, evaluation=True)]
    assert learning.episode_seconds_p50(events) == {"generate": 2.0, "commands": 1.0,
                                                    "total": 4.0}
    assert learning.episode_seconds_p50([episode(3.0, evaluation=True)]) is None


def test_engine_figures_are_the_interval_s_deltas() -> None:
    before = {"sglang:generation_tokens_total": 100.0, "sglang:num_requests_total": 4.0,
              "sglang:inter_token_latency_seconds_sum": 1.0,
              "sglang:inter_token_latency_seconds_count": 100.0}
    after = {"sglang:generation_tokens_total": 1100.0, "sglang:num_requests_total": 14.0,
             "sglang:inter_token_latency_seconds_sum": 13.0,
             "sglang:inter_token_latency_seconds_count": 1100.0}
    figures = learning.engine_figures(before, after, 10.0)
    assert figures["tokens_per_s"] == 100.0 and figures["requests"] == 10.0
    assert figures["itl_mean_ms"] == 12.0  # 12 s over 1,000 tokens
    assert figures["ttft_mean_ms"] is None  # not exposed: not made up
    # a series born after the first read (labelled children appear on first use) counts from 0
    later = learning.engine_figures({}, {"sglang:num_requests_total": 7.0}, 1.0)
    assert later["requests"] == 7.0
    assert learning.engine_figures({}, {}, 10.0)["tokens_per_s"] is None


def test_an_evaluation_still_running_is_not_reported_as_a_score() -> None:
    # Read when the RL budget ended: version 20's first task was done (1.0), nine were not.
    summary = {"0": {"mean_success": 0.1, "done": 10, "expected": 10},
               "10": {"mean_success": 0.2, "done": 10, "expected": 10},
               "20": {"mean_success": 1.0, "done": 1, "expected": 10}}
    assert learning.evaluations_by_version(summary) == {
        "eval_by_weight_version": {"0": 0.1, "10": 0.2},
        "eval_unfinished": {"20": "1/10 episodes"}}


def test_auto_dtype_is_bf16_only_where_the_processor_has_bf16_units(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl\n")
    assert learning._resolve_dtype("auto", "cpu", cpuinfo) == "float32"  # bf16 only emulated
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert learning._resolve_dtype("auto", "cpu", cpuinfo) == "bfloat16"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    assert learning._resolve_dtype("auto", "cpu", cpuinfo) == "bfloat16"
    assert learning._resolve_dtype("auto", "cuda", cpuinfo) == "bfloat16"
    assert learning._resolve_dtype("float32", "cuda", cpuinfo) == "float32"


def test_on_cpu_the_engine_and_the_trainer_each_get_half_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common import cpu_split

    monkeypatch.setattr(cpu_split.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    cpu = learning._config(tmp_path, tmp_path / "model", learning.parse_args([]))
    engine_args = list(cpu.rollout.fleet.builtin_args)
    assert engine_args[engine_args.index("--num-threads") + 1] == "2"
    assert cpu.trainer.cpu_threads == 2
    monkeypatch.setattr(cpu_split.os, "sched_getaffinity", lambda _pid: {0})
    assert learning.parse_args([]).trainer_threads == learning.parse_args([]).engine_threads == 1
    gpu = learning.parse_args(["--device", "cuda"])
    assert (gpu.engine_threads, gpu.trainer_threads) == (2, 0)  # the GPU does the work there
    flags = learning.parse_args(["--engine-threads", "3", "--trainer-threads", "5"])
    assert (flags.engine_threads, flags.trainer_threads) == (3, 5)


def test_a_wall_budget_cuts_the_rl_phase_to_leave_room_for_the_end() -> None:
    # started at 0, RL from 60 s (the initial eval took 40 s), a 6-minute RL budget
    assert learning.rl_deadline(0.0, 60.0, 6.0, None, 40.0) == 420.0
    # a 10-minute wall: the end needs 1.5 x 40 + 45 = 105 s, so RL ends at 495 s
    assert learning.rl_deadline(0.0, 60.0, 8.0, 10.0, 40.0) == 600.0 - 105.0
    # a wall roomy enough changes nothing; one too small leaves no RL, not a negative budget
    assert learning.rl_deadline(0.0, 60.0, 6.0, 10.0, 40.0) == 420.0
    assert learning.rl_deadline(0.0, 60.0, 6.0, 1.0, 40.0) == 60.0
    args = learning.parse_args(["--device", "cuda", "--wall-budget-min", "9.5"])
    assert args.wall_budget_min == 9.5 and learning.parse_args([]).wall_budget_min is None
