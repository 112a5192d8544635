"""The learning run: a real small model, the starter tasks, the whole fully-async loop.

SmolLM2-135M-Instruct (`riptide model fetch smollm2-135m`, or `--model FOLDER`), optionally
warm-started first (`--warm-start-steps N`: `riptide sft` on the oracle solutions of
tasks/starter/train, reported as its own figure), then trains with RL on tasks/starter/train
through the local stack (Redis, router, rollout with a built-in engine, sandbox with local
sandboxes, trainer), the markdown-bash protocol, evaluation of tasks/starter/heldout during
training every `--eval-interval` weight versions. Before and after RL, `riptide eval` scores the
held-out tasks greedily with the RL run's initial weights (the warm-started ones, if any) and
with its last checkpoint: same tasks, same settings, same engine. The baseline is the RL run's
initial model; `rl_from` says which it is.

On CPU the engine and the trainer compute in bfloat16 where the processor has bf16 matrix
units (avx512_bf16 or amx_bf16: several times faster than fp32 there) and in float32 where it
has none (bf16 matmuls then run about twice as slow as fp32 on AVX-512, where oneDNN emulates
them, and about fifty times on AVX2): `--dtype auto`; Adam keeps fp32 master weights.
The trainer scores each group's shared prompt once per micro-batch (`trainer.shared_prefix`,
packed rows; `--no-shared-prefix` for whole rows) and checkpoints every 5 steps; on a machine
with less than 10 GiB available it also recomputes each layer's activations in the backward
(`--recompute`) and streams Adam's state through disk (`--optimizer-on-disk`). Tasks are drawn
by the chance that their next group has reward variance (`--task-sampling informative`).

While it runs it prints (to stderr) the line `riptide up` prints for each trainer step and
each finished evaluation. The trainer stops itself after `--steps`; when the budget runs out
first, the stop lets it finish the step it is in. Either way the figures are counted after the
stop from what the run saved: `steps` (and `per_step_reward`) from its trainer.step events,
`checkpoint_step` from its checkpoints, the one the final eval scores; the two are equal.

On one GPU (`--device cuda`, `make learn-gpu`) the same loop runs colocated: the engine and the
trainer share the GPU, weights move through CUDA IPC (`trainer.weight_sync.mode = "colocated"`),
and the defaults are chosen for learning rather than for two cores (GPU_DEFAULTS: 100 steps, 128
episodes in flight, two groups of 8 a step, no recompute, Adam in memory). Each held-out eval
then also scores 4 episodes a task at T 0.8 on the same engine (`--eval-samples`), and the
JSON adds the engine's tokens/s over the RL phase (its own generation counter), the weight
sync's seconds per step and the memory of the trainer (its CUDA allocator's peak) and of the
engine (weights, KV slots and what its CUDA allocator reserved; on CPU the first two).

To say what holds the steps back, the JSON also has, over the RL phase: the engine's mean
inter-token, first-token, queue and request latencies (`engine`), the medians of where a
training episode's time went (`episode_seconds_p50`), and each service's CPU (`cpu`: cores
busy, and its busiest thread's share of the phase; a share near 1 is a saturated loop).

Usage: python bench/learning.py [--device cpu|cuda] [--steps 40] [--budget-min 30]
                                [--wall-budget-min W] [--warm-start-steps 0]
(`--wall-budget-min`: the whole bench ends within W minutes; the RL phase is cut short where
the stop and the final evaluation, estimated from the initial one, would not fit after it.)
Last line: {"steps": n, "checkpoint_step": n, "per_step_reward": [...], "heldout_initial": x,
            "heldout_final": y,
            "eval_by_weight_version": {...}, "eval_unfinished": {...},
            "warm_start": {...} | null, "wall_s": ...}
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.common.checkpoint_steps import latest_checkpoint_step
from services.common.config import dump_config
from services.common.cpu_split import threads_each
from services.common.events import Event, load_events
from services.common.progress import StepProgress, cache_hit_rate
from services.local_stack import LocalStack, local_config, trainer_finished
from services.testing.cpu_sampler import CpuSnapshot, cpu_use, snapshot

REPO = Path(__file__).resolve().parents[1]
STARTER = REPO / "tasks" / "starter"
AGENT = {"protocol": "markdown_bash", "max_turns": 3, "max_new_tokens": 64,
         "max_context_tokens": 2048, "wall_time_s": 300.0, "default_command_timeout_s": 10.0}


#: Below this much available memory the CPU run recomputes activations and streams Adam's
#: state through disk: SmolLM2-135M's float32 step then peaks at 2.4 GiB instead of 4.9
#: (bench/trainer_memory.py at the run's shape), for 70 s a step instead of 59 on two cores.
LOW_MEMORY_GIB = 10


def _low_memory(meminfo: Path = Path("/proc/meminfo")) -> bool:
    """Whether this machine has less than LOW_MEMORY_GIB available (True where unknown)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        return int(fields["MemAvailable"].split()[0]) < LOW_MEMORY_GIB * 2**20
    except (OSError, KeyError, ValueError):
        return True


#: x86 flags of bf16 matrix units; oneDNN also runs bf16 on AVX-512 without them, emulated:
#: SmolLM2-135M's training step there took 123 s in bf16 against 59 s in float32.
BF16_UNITS = frozenset({"avx512_bf16", "amx_bf16"})


def _resolve_dtype(dtype: str, device: str = "cpu", cpuinfo: Path = Path("/proc/cpuinfo")
                   ) -> str:
    """`auto`: bfloat16 on a GPU and on a processor with bf16 matrix units, else float32.
    Where the processor's flags cannot be read, oneDNN's own answer decides."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    try:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is not None:
        return "bfloat16" if BF16_UNITS.intersection(flags) else "float32"
    import torch

    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def _eval(checkpoint: Path, base: Path | None, work: Path, args: argparse.Namespace
          ) -> dict[str, Any]:
    """`riptide eval` of the held-out tasks: greedy, then `--eval-samples` episodes a task at
    T 0.8 on the same engine (under the key `sampled`)."""
    cmd = [sys.executable, "-m", "services.cli", "eval", "--tasks", str(STARTER / "heldout"),
           "--checkpoint", str(checkpoint), "--greedy", "--dir", str(work),
           "--engine-dtype", args.dtype, "--engine-device", args.device,
           "--concurrency", str(args.eval_concurrency),
           "--also-sampled", str(args.eval_samples), "--temperature", "0.8",
           "--protocol", AGENT["protocol"], "--max-turns", str(AGENT["max_turns"]),
           "--max-new-tokens", str(AGENT["max_new_tokens"]),
           "--max-context-tokens", str(AGENT["max_context_tokens"])]
    if base is not None:
        cmd += ["--base", str(base)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"riptide eval failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _warm_start(model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`riptide sft` on the training tasks' oracle solutions; its JSON (with `hf`, the folder)."""
    cmd = [sys.executable, "-m", "services.cli", "sft", "--tasks", str(STARTER / "train"),
           "--model", str(model), "--protocol", AGENT["protocol"], "--out", str(out),
           "--steps", str(args.warm_start_steps), "--batch-size", "4",
           "--lr", str(args.warm_start_lr), "--dtype", args.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"riptide sft failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _tasks_dir(run_dir: Path) -> Path:
    """Both splits in one folder for the sandbox service (held-out ones are never trained)."""
    folder = run_dir / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for task in sorted(STARTER.glob("*/*/task.toml")):
        link = folder / task.parent.name
        if not link.exists():
            link.symlink_to(task.parent)
    return folder


def _config(run_dir: Path, model: Path, args: argparse.Namespace) -> Any:
    train = sorted(p.parent.name for p in (STARTER / "train").glob("*/task.toml"))
    heldout = sorted(p.parent.name for p in (STARTER / "heldout").glob("*/task.toml"))
    return local_config(run_dir, {
        "rollout": {"task_ids": train, "scheduler": {
            "max_concurrent_samples": args.in_flight, "n_samples_per_prompt": args.group_size,
            "num_groups_per_batch": args.groups_per_step, "max_new_tokens": AGENT["max_new_tokens"],
            "temperature": 0.8, "max_staleness": args.max_staleness,
            "drop_zero_variance_groups": True,
            "zero_variance_cooldown_passes": args.cooldown_passes,
            "task_sampling": args.task_sampling},
            "fleet": {"model_path": str(model), "start_timeout_s": 600.0,
                      "builtin_args": ["--num-threads", str(args.engine_threads),
                                       "--dtype", args.dtype, "--device", args.device,
                                       # every episode in flight decodes in one batch
                                       "--max-running-requests", str(max(64, args.in_flight))]},
            "eval": {"interval_steps": args.eval_interval, "task_ids": heldout,
                     "greedy": True}},
        "sandbox": {"tasks_dir": str(_tasks_dir(run_dir)), "tokenizer_path": str(model),
                    "max_concurrent_episodes": args.in_flight, "agent": AGENT},
        "trainer": {"rollout_batch_size": args.groups_per_step,
                    "cpu_threads": args.trainer_threads,
                    "checkpoint": {"interval_steps": args.checkpoint_interval},
                    "max_tokens_per_microbatch": args.microbatch_tokens,
                    "packed_sequences": args.shared_prefix, "shared_prefix": args.shared_prefix,
                    "model": {"hf_path": str(model), "dtype": args.dtype, **(
                        {"recompute_granularity": "full", "recompute_method": "uniform",
                         "recompute_num_layers": 1} if args.recompute else {})},
                    "optimizer": {"lr": args.lr, "stream_optimizer_state_to_disk": (
                        str(run_dir / "adam-state") if args.optimizer_on_disk else None)},
                    # One GPU: no NCCL group between two processes on one device; the
                    # trainer hands its weights over through CUDA IPC (docs/colocated.md).
                    "weight_sync": {"dtype": args.dtype, **(
                        {"mode": "colocated", "bucket_mb": None}  # the mode's own (2 GiB)
                        if args.device == "cuda" else {})}},
    })


def evaluations_by_version(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rollout's evaluations, read when the RL budget ends: `eval_by_weight_version` holds
    the mean success of each finished one; one still running (its mean is over the tasks done
    so far, so it would read as a score it is not) goes to `eval_unfinished` as its count of
    episodes done and expected."""
    finished, unfinished = {}, {}
    for version, evaluation in summary.items():
        done, expected = evaluation.get("done"), evaluation.get("expected")
        if done is not None and done == expected:
            finished[version] = evaluation.get("mean_success")
        else:
            unfinished[version] = f"{done}/{expected} episodes"
    return {"eval_by_weight_version": finished, "eval_unfinished": unfinished}


def _details(config: Any, name: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {config.run.admin_token}"}
    try:
        reply = httpx.get(f"{getattr(config, name).admin_url}/admin/state", headers=headers,
                          timeout=5)
        return dict(reply.json().get("details") or {})
    except (httpx.HTTPError, ValueError):
        return {}


def _engine_url(config: Any) -> str | None:
    engines = _details(config, "rollout").get("engines") or []
    return str(engines[0]["url"]).rstrip("/") if engines and engines[0].get("url") else None


#: the engine's /metrics samples the run reads, summed over its label sets
_ENGINE_SAMPLES = ("sglang:generation_tokens_total", "sglang:num_requests_total") + tuple(
    f"sglang:{h}_seconds_{part}" for h in (
        "inter_token_latency", "time_to_first_token", "queue_time", "e2e_request_latency")
    for part in ("sum", "count"))


def _engine_counters(url: str | None) -> dict[str, float]:
    """The engine's own counters and latency histograms' sums and counts, so far."""
    if url is None:
        return {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _ENGINE_SAMPLES:
                counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    return counters


def engine_figures(before: dict[str, float], after: dict[str, float], wall_s: float
                   ) -> dict[str, float | None]:
    """The engine over an interval: tokens/s, requests finished and the mean inter-token,
    first-token, queue and request latencies (ms) of what it served in between."""
    def delta(name: str) -> float | None:  # a series the engine had not started yet is 0
        return after[name] - before.get(name, 0.0) if name in after else None

    def mean_ms(histogram: str) -> float | None:
        total, count = (delta(f"sglang:{histogram}_seconds_{p}") for p in ("sum", "count"))
        return None if total is None or not count else round(1000 * total / count, 2)

    tokens = delta("sglang:generation_tokens_total")
    return {"tokens_per_s": None if tokens is None else round(tokens / max(wall_s, 1e-9), 1),
            "requests": delta("sglang:num_requests_total"),
            "itl_mean_ms": mean_ms("inter_token_latency"),
            "ttft_mean_ms": mean_ms("time_to_first_token"),
            "queue_mean_ms": mean_ms("queue_time"),
            "request_mean_ms": mean_ms("e2e_request_latency")}


def _engine_memory_gib(config: Any, url: str | None) -> dict[str, float]:
    """The engine's memory split (weights, KV slots, what its CUDA allocator reserved), GiB."""
    if url is None:
        return {}
    try:
        info = httpx.get(f"{url}/get_server_info", timeout=10, headers={
            "Authorization": f"Bearer {config.run.engine_api_key}"}).json()
    except (httpx.HTTPError, ValueError):
        return {}
    usage = info.get("memory_usage") or {}
    return {k.removesuffix("_bytes") + "_gib": round(v / 2**30, 3) for k, v in usage.items()}


def _rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its children (the trainer's ranks), in MB."""
    try:
        out = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)],
                             capture_output=True, text=True, check=False).stdout
    except OSError:
        return 0.0
    return sum(int(v) for v in out.split()) / 1024


def _cache_hit_rate(events: list[Event]) -> float | None:
    """The run's prefix-cache hit rate, from its last load snapshot."""
    loads = [e for e in events if e.kind == "rollout.load"]
    rate = cache_hit_rate(loads[-1]) if loads else None
    return None if rate is None else round(rate, 3)


def episode_seconds_p50(events: list[Event]) -> dict[str, float] | None:
    """Medians over the run's training episodes of where their time went (queued, create,
    generate, commands, verify, total), as the sandbox service measured it."""
    seconds = [e.attrs["seconds"] for e in events if e.kind == "rollout.episode"
               and not e.attrs.get("eval") and isinstance(e.attrs.get("seconds"), dict)]
    if not seconds:
        return None
    return {name: round(statistics.median(float(s.get(name, 0.0)) for s in seconds), 3)
            for name in seconds[0]}


def _success_line(result: dict[str, Any]) -> str:
    """`greedy 0.1 (task, ...)`, and the sampled pass's success where there is one."""
    solved = [t for t, r in result["tasks"].items() if r["success"] > 0]
    line = f"greedy {result['mean_success']:.2f} ({', '.join(solved) or 'none'})"
    sampled = result.get("sampled")
    if sampled:
        line += (f"; {sampled['samples']} samples at T {sampled['temperature']}: "
                 f"{sampled['mean_success']:.3f}")
    return line


#: What the end of a run needs after its RL phase, as a multiple of the initial evaluation's
#: time (the final one exports the checkpoint first) plus the stack's stop.
FINAL_EVAL_FACTOR, STOP_S = 1.5, 45.0


def rl_deadline(started: float, rl_started: float, budget_min: float,
                wall_budget_min: float | None, initial_eval_s: float) -> float:
    """When the RL phase ends: after `budget_min`, or earlier where the whole bench must end
    within `wall_budget_min` of `started` and the stop and the final evaluation (estimated
    from the initial one) would not fit after it."""
    deadline = rl_started + budget_min * 60
    if wall_budget_min is not None:
        reserve = FINAL_EVAL_FACTOR * initial_eval_s + STOP_S
        deadline = min(deadline, started + wall_budget_min * 60 - reserve)
    return max(deadline, rl_started)


def trained_steps(events: list[Event]) -> dict[int, dict[str, Any]]:
    """Each trained step's figures, from the saved events: the steps the trainer trained,
    including one it finished on the way out when the budget ran out (a step retrained after
    a crash counts once, with its last figures)."""
    return {int(e.attrs["step"]): e.attrs for e in events if e.kind == "trainer.step"}


#: What a flag left out means, per device: two CPU cores, or one GPU shared by engine and
#: trainer (colocated). The GPU's are chosen for learning: more episodes in flight, more
#: groups a step, no recompute, Adam's state in memory; the CPU saves memory
#: ("low-memory") only on a machine short of it.
CPU_DEFAULTS: dict[str, Any] = {
    "steps": 40, "budget_min": 30.0, "in_flight": 16, "group_size": 8, "groups_per_step": 1,
    "microbatch_tokens": 2048, "recompute": "low-memory", "optimizer_on_disk": "low-memory",
    "eval_interval": 10, "checkpoint_interval": 5, "eval_samples": 0, "eval_concurrency": 5,
    "max_staleness": 2, "engine_threads": "half-cores", "trainer_threads": "half-cores"}
GPU_DEFAULTS: dict[str, Any] = {
    "steps": 100, "budget_min": 6.0, "in_flight": 128, "group_size": 8, "groups_per_step": 2,
    "microbatch_tokens": 8192, "recompute": False, "optimizer_on_disk": False,
    "eval_interval": 25, "checkpoint_interval": 25, "eval_samples": 4, "eval_concurrency": 40,
    "max_staleness": 4, "engine_threads": 2, "trainer_threads": 0}


def _cpu_default(value: Any) -> Any:
    """A default that depends on the machine: "low-memory" (recompute, Adam on disk) and
    "half-cores" (the engine's and the trainer's threads: cpu_split.py)."""
    if value == "low-memory":
        return _low_memory()
    if value == "half-cores":
        return threads_each()
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: engine and trainer share one GPU (colocated weight sync)")
    parser.add_argument("--steps", type=int, default=None, help="default: 40 on CPU, 100 on GPU")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="wall time of the RL phase (default: 30 on CPU, 6 on GPU)")
    parser.add_argument("--wall-budget-min", type=float, default=None,
                        help="wall time of the whole bench, from its start: the RL phase ends "
                        "early enough to leave the stop and the final evaluation the time they "
                        "need (for a job with a time limit; default: none)")
    parser.add_argument("--model", type=Path, default=None, help="default: smollm2-135m")
    parser.add_argument("--dir", type=Path, default=REPO / ".riptide" / "learn")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--groups-per-step", type=int, default=None,
                        help="default: 1 on CPU, 2 on GPU")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="episodes in flight (default: 16 on CPU, two groups decoding as "
                        "one batch; 128 on GPU)")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="weight versions a sample may lag the trainer (default: 2 on CPU, "
                        "4 on GPU); it also caps the episodes in flight at (max_staleness + 1) "
                        "x groups a step x group size (the rollout's admission rule)")
    parser.add_argument("--task-sampling", default="informative",
                        choices=("informative", "cycle"),
                        help="informative: tasks drawn by the chance that a group of them has "
                        "reward variance; cycle: shuffled passes with a cooldown")
    parser.add_argument("--cooldown-passes", type=int, default=2,
                        help="cycle: passes a task sits out after a zero-variance group")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="the engine's torch threads (default: half the cores on CPU, where "
                        "the trainer has the other half; 2 on GPU)")
    parser.add_argument("--trainer-threads", type=int, default=None,
                        help="the trainer's torch threads (default: half the cores on CPU; 0, "
                        "one per core, on GPU)")
    parser.add_argument("--microbatch-tokens", type=int, default=None,
                        help="trainer micro-batch size (CPU: 2048 holds a group's shared prompt "
                        "and its 8 continuations; GPU: 8192)")
    parser.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                        help="packed rows, each group's prompt scored once (trainer.shared_prefix)")
    parser.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                        help="recompute each layer's activations in the backward (default: "
                        f"on a CPU machine with less than {LOW_MEMORY_GIB} GiB available, where "
                        "it keeps the trainer under 3 GB at 15%% more time a step; off "
                        "elsewhere)")
    parser.add_argument("--optimizer-on-disk", action=argparse.BooleanOptionalAction,
                        default=None, help="Adam's fp32 state in files under the run dir "
                        "(default as --recompute)")
    parser.add_argument("--eval-interval", type=int, default=None,
                        help="weight versions between evaluations during training")
    parser.add_argument("--checkpoint-interval", type=int, default=None,
                        help="trainer steps between checkpoints (the last step is always "
                        "checkpointed when the run stops; the final eval scores it)")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="held-out episodes a task at T 0.8 besides the greedy one, before "
                        "and after RL (default: 0 on CPU, 4 on GPU)")
    parser.add_argument("--eval-concurrency", type=int, default=None,
                        help="held-out episodes at once in the before/after evals")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="engine and trainer compute dtype (auto: bfloat16 on a GPU and "
                        "on a CPU with bf16 matrix units, avx512_bf16 or amx_bf16; else "
                        "float32)")
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="riptide sft steps (4 trajectories each) before RL; 0 (the "
                        "default): RL from the raw model")
    parser.add_argument("--warm-start-lr", type=float, default=3e-5)
    args = parser.parse_args(argv)
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, _cpu_default(value))
    args.dtype = _resolve_dtype(args.dtype, args.device)
    return args


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    if args.model is None:
        from services.common.model_fetch import fetch_model

        args.model = fetch_model("smollm2-135m", Path.home() / ".cache" / "riptide" / "models")
    run_dir = args.dir
    if run_dir.exists():  # a fresh run each time: a stale checkpoint would be resumed
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    warm: dict[str, Any] | None = None
    rl_from = "raw model (no warm start)"
    if args.warm_start_steps:
        warm = _warm_start(args.model, run_dir / "sft", args)
        args.model = run_dir / "sft" / "hf"
        rl_from = f"warm start: riptide sft, {args.warm_start_steps} steps"
    print(f"[learn] held-out eval of the initial weights ({args.model})", file=sys.stderr,
          flush=True)
    eval_started = time.monotonic()
    initial = _eval(args.model, None, run_dir / "eval-initial", args)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say(f"[learn] initial held-out success {_success_line(initial)}")
    rl_started = time.monotonic()
    deadline = rl_deadline(started, rl_started, args.budget_min, args.wall_budget_min,
                           rl_started - eval_started)
    rl_budget_s = deadline - rl_started
    if rl_budget_s < args.budget_min * 60:
        say(f"[learn] RL budget {rl_budget_s / 60:.1f} min, not {args.budget_min:g}: the "
            f"{args.wall_budget_min:g}-minute wall budget leaves the rest to the stop and the "
            "final evaluation")
    config = _config(run_dir, args.model, args)
    path = run_dir / "config.toml"
    path.write_text(dump_config(config))
    # The trainer stops itself after --steps; a stop at the budget lets it finish its step.
    stack = LocalStack(run_dir, path, say=say, max_steps=args.steps)
    progress = StepProgress(config.redis, config.run.name, args.steps)
    trainer_rss_mb = 0.0
    engine_memory: dict[str, float] = {}
    engine_before: dict[str, float] = {}
    engine: dict[str, float | None] = {}
    cpu_before: CpuSnapshot | None = None
    cpu: dict[str, dict[str, object]] = {}
    try:
        stack.start(ready_timeout_s=900)
        engine_url = _engine_url(config)
        engine_started = time.monotonic()
        engine_before = _engine_counters(engine_url)
        cpu_before = snapshot({n: c.pid for n, c in stack.children.items()})
        while not trainer_finished(config, args.steps) and time.monotonic() < deadline:
            stack.check_children()  # restarts a dead service; raises when one keeps dying
            child = stack.children.get("trainer")
            if child is not None:
                trainer_rss_mb = max(trainer_rss_mb, _rss_mb(child.pid))
            for line in progress.poll():  # the lines `riptide up` prints, steps and evals
                say(line)
            time.sleep(1.0)
        engine = engine_figures(engine_before, _engine_counters(engine_url),
                                time.monotonic() - engine_started)
        cpu = cpu_use(cpu_before, snapshot({n: c.pid for n, c in stack.children.items()}))
        engine_memory = _engine_memory_gib(config, engine_url)
        rollout = _details(config, "rollout").get("scheduler", {})
        trainer = _details(config, "trainer")
    finally:
        stack.stop()
        for line in progress.poll():
            say(line)
        progress.close()
    rl_wall_s = time.monotonic() - rl_started
    # Counted after the stop, from what the run saved: the steps trained and the checkpoints.
    events = load_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    steps = trained_steps(events)
    checkpoint_step = latest_checkpoint_step(run_dir / "checkpoints")
    final = (_eval(run_dir / "checkpoints" / f"step-{checkpoint_step:08d}", args.model,
                   run_dir / "eval-final", args) if checkpoint_step else {})
    if final:
        say(f"[learn] final held-out success {_success_line(final)}")
    last_step = steps[max(steps)] if steps else {}
    last_metrics = (trainer.get("last_step") or {}).get("metrics") or {}
    print(json.dumps({
        "model": str(args.model), "rl_from": rl_from, "device": args.device,
        "dtype": args.dtype, "weight_sync": config.trainer.weight_sync.mode,
        "settings": {k: getattr(args, k) for k in (
            "steps", "budget_min", "wall_budget_min", "in_flight", "max_staleness", "group_size",
            "groups_per_step", "lr", "microbatch_tokens", "recompute", "eval_samples",
            "engine_threads", "trainer_threads")},
        "shared_prefix": args.shared_prefix,
        "steps": max(steps, default=0), "checkpoint_step": checkpoint_step,
        "groups_trained": sum(int(a.get("groups") or 0) for a in steps.values()),
        "per_step_reward": [round(float(steps[k]["reward_mean"]), 4) for k in sorted(steps)],
        "heldout_initial": initial["mean_success"],
        "heldout_final": final.get("mean_success"),
        **evaluations_by_version(rollout.get("eval") or {}),
        "groups_dropped": rollout.get("dropped_groups"),
        "mismatch_kl_last_step": last_step.get("mismatch_kl"),
        "trainer_idle_fraction": round(trainer.get("total_wait_s", 0.0) / rl_wall_s, 3),
        "trainer_peak_rss_mb": round(trainer_rss_mb),
        "heldout_sampled_initial": (initial.get("sampled") or {}).get("mean_success"),
        "heldout_sampled_final": (final.get("sampled") or {}).get("mean_success"),
        "eval_samples": args.eval_samples,
        "engine_tokens_per_s": engine.get("tokens_per_s"),
        # the engine over the RL phase: requests, mean inter-token / first-token / queue ms
        "engine": engine,
        # each service's process tree: cores busy, and its busiest thread's share of the phase
        "cpu": cpu,
        "weight_sync_s_per_step": round(trainer["total_weight_sync_s"]
                                        / trainer["steps_recorded"], 4)
        if trainer.get("steps_recorded") else None,
        "trainer_step_s_per_step": round(trainer["total_step_s"] / trainer["steps_recorded"], 3)
        if trainer.get("steps_recorded") else None,
        # what fed the trainer: episodes scored, how many ran at once, how long a group took
        "rollout": {k: rollout.get(k) for k in (
            "finished_samples", "mean_in_flight", "group_latency_s_p50",
            "staleness_of_written_groups")},
        # the trainer's allocator peak (on a GPU) and the engine's split at the end
        "memory_gib": {"trainer_peak_cuda_reserved": round(
            last_metrics["cuda_peak_reserved_gib"], 3)
            if "cuda_peak_reserved_gib" in last_metrics else None,
            "engine": engine_memory},
        "cache_hit_rate": _cache_hit_rate(events),
        "episode_seconds_p50": episode_seconds_p50(events),
        "task_sampler_at_end": rollout.get("task_sampler"),
        "heldout_initial_tasks": {t: r["success"] for t, r in initial["tasks"].items()},
        "heldout_final_tasks": {t: r["success"] for t, r in (final.get("tasks") or {}).items()},
        "warm_start": None if warm is None else {
            "steps": warm.get("steps"), "losses": warm.get("losses"),
            "wall_s": warm.get("wall_s")},
        "rl_budget_s": round(rl_budget_s, 1), "rl_wall_s": round(rl_wall_s, 1),
        "wall_s": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
