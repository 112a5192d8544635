"""Generation and training on the same CPU cores: the built-in engine decoding beside a
trainer stepping, for several splits of the cores' threads between them.

The engine (its own process: SmolLM2-135M in `--dtype`, `--num-threads E`) serves `--batch`
concurrent requests round after round (each worker's own `--prompt-tokens` prompt, cached
after its first round, then `--new-tokens` new tokens at T 0.8, ignore_eos), as the episodes
in flight of the learning run decode in one batch. The trainer (its own process, `python
bench/cpu_sharing.py --role trainer`: the trainer's own path, `build_policy` and
`train_step`, on the learning run's groups as bench/shared_prefix.py builds them, shared
prefixes, `torch.set_num_threads(T)`) steps `--steps` times after a first step. Splits:

- `shared`: E = T = the cores (what the learning run did: each one thread per core);
- `shared_passive`: the same with OMP_WAIT_POLICY=PASSIVE in both (OpenMP threads waiting at
  a barrier sleep instead of spinning on the cores the other process needs);
- `halves`: E = T = half the cores, unpinned;
- `pinned`: E = T = half the cores, the engine on the first half, the trainer on the other
  (sched_setaffinity of every thread of each process).

Each process is first measured alone at each thread count the splits use (the engine's
tokens/s over `--window-s`; the trainer's median step), then each split together: the
engine's tokens/s over the trainer's timed steps (its /metrics counter) and the trainer's
median step. "fraction" is a figure together over the same process alone on all the cores:
a split whose two fractions add up to more than 1 gets more of both out of the cores than
taking turns would. The last line printed is the JSON.

    python bench/cpu_sharing.py [--model DIR] [--splits shared,halves,pinned] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from shared_prefix import agent_groups  # noqa: E402

from services.testing.engine_process import EngineProcess  # noqa: E402

SPLITS = ("shared", "shared_passive", "halves", "pinned")
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _split_threads(split: str) -> tuple[int, int, list[int] | None, list[int] | None]:
    """(engine threads, trainer threads, engine cores, trainer cores) of a split."""
    cores = _cores()
    if split.startswith("shared"):
        return len(cores), len(cores), None, None
    half = max(1, len(cores) // 2)
    if split == "halves":
        return half, half, None, None
    return half, half, cores[:half], cores[half:] or cores[:half]


def _split_env(split: str) -> dict[str, str]:
    return PASSIVE if split == "shared_passive" else {}


def _pin_process(pid: int, cores: list[int]) -> None:
    """Every thread of process `pid` on `cores` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            pass


def trainer_role(args: argparse.Namespace) -> None:
    """The trainer side: steps on the learning run's groups, one JSON line per step."""
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.data.batch import pack_groups
    from services.trainer.megatron_policy import build_policy
    from services.trainer.step import train_step

    torch.set_num_threads(args.threads)
    config = TrainerConfig(model={"hf_path": str(args.model), "dtype": args.dtype},
                           max_tokens_per_microbatch=args.micro_tokens, optimizer={"lr": 1e-7},
                           packed_sequences=True, shared_prefix=True)  # fmt: skip
    policy = build_policy(config).policy
    batch = pack_groups(agent_groups(args, 49152), True, args.micro_tokens, packed=True,
                        shared_prefix=True)  # fmt: skip
    print(json.dumps({"ready": time.time()}), flush=True)
    for step in range(args.steps + 1):
        start = time.time()
        train_step(policy, batch, config.loss.settings())
        print(json.dumps({"step": step, "start": start, "end": time.time()}), flush=True)


def _run_trainer(args: argparse.Namespace, threads: int, cores: list[int] | None,
                 on_step: Any = None, extra_env: dict[str, str] | None = None
                 ) -> list[dict[str, float]]:  # fmt: skip
    cmd = [sys.executable, __file__, "--role", "trainer", "--threads", str(threads),
           "--model", str(args.model), "--dtype", args.dtype, "--steps", str(args.steps),
           "--micro-tokens", str(args.micro_tokens)]
    env = {**os.environ, **(extra_env or {}),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=pin)
    steps = []
    assert proc.stdout is not None
    for line in proc.stdout:
        record = json.loads(line)
        if "step" in record:
            steps.append(record)
            if on_step is not None:
                on_step(record)
    if proc.wait() != 0:
        raise RuntimeError(f"the trainer process exited with {proc.returncode}")
    return steps


def _trainer_step_s(steps: list[dict[str, float]]) -> float:
    return round(statistics.median(s["end"] - s["start"] for s in steps[1:]), 2)


class EngineLoad:
    """The engine process and `batch` workers posting requests to it until stopped."""

    def __init__(self, args: argparse.Namespace, threads: int, cores: list[int] | None,
                 extra_env: dict[str, str] | None = None) -> None:
        saved = dict(os.environ)
        os.environ.update(extra_env or {})  # the engine's process inherits it
        try:
            self.engine = EngineProcess(args.model, start_timeout_s=600, extra_args=[
                "--num-threads", str(threads), "--dtype", args.dtype, "--device", "cpu",
                "--max-running-requests", str(max(64, args.batch))])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if cores:
            _pin_process(self.engine.proc.pid, cores)
        self.args, self.stopping = args, threading.Event()
        self.workers = [threading.Thread(target=self._work, args=(i,), daemon=True)
                        for i in range(args.batch)]
        for worker in self.workers:
            worker.start()

    def _work(self, seed: int) -> None:
        import random

        rng = random.Random(seed)
        prompt = [rng.randrange(100, 49000) for _ in range(self.args.prompt_tokens)]
        client = httpx.Client(base_url=self.engine.url, timeout=600)
        while not self.stopping.is_set():
            try:
                client.post("/generate", json={"input_ids": prompt, "sampling_params": {
                    "max_new_tokens": self.args.new_tokens, "temperature": 0.8,
                    "ignore_eos": True, "sampling_seed": rng.randrange(2**31)}})
            except httpx.HTTPError:
                if not self.stopping.is_set():
                    raise

    def tokens(self) -> float:
        """The engine's generated tokens so far (its /metrics counter)."""
        text = httpx.get(f"{self.engine.url}/metrics", timeout=30).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "sglang:generation_tokens_total")

    def rate_over(self, seconds: float) -> float:
        before, start = self.tokens(), time.monotonic()
        time.sleep(seconds)
        return (self.tokens() - before) / (time.monotonic() - start)

    def close(self) -> None:
        self.stopping.set()
        self.engine.stop()


def _engine_alone(args: argparse.Namespace, threads: int) -> float:
    load = EngineLoad(args, threads, None)
    try:
        load.rate_over(args.warmup_s)
        return round(load.rate_over(args.window_s), 1)
    finally:
        load.close()


def _together(args: argparse.Namespace, split: str) -> dict[str, Any]:
    engine_threads, trainer_threads, engine_cores, trainer_cores = _split_threads(split)
    load = EngineLoad(args, engine_threads, engine_cores, _split_env(split))
    marks: list[tuple[float, float]] = []  # (wall time, engine tokens) at each step's end
    try:
        load.rate_over(args.warmup_s)
        steps = _run_trainer(args, trainer_threads, trainer_cores,
                             lambda record: marks.append((time.time(), load.tokens())),
                             _split_env(split))
    finally:
        load.close()
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    return {"engine_threads": engine_threads, "trainer_threads": trainer_threads,
            "engine_cores": engine_cores, "trainer_cores": trainer_cores,
            "engine_tokens_per_s": round((n1 - n0) / (t1 - t0), 1),
            "trainer_step_s": _trainer_step_s(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("bench", "trainer"), default="bench")
    parser.add_argument("--model", type=Path,
                        default=Path.home() / ".cache/riptide/models/smollm2-135m")  # fmt: skip
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=2, help="timed trainer steps a run")
    parser.add_argument("--threads", type=int, default=0, help="(the trainer role's)")
    parser.add_argument("--batch", type=int, default=16, help="requests decoding at once")
    parser.add_argument("--prompt-tokens", type=int, default=325)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    # the learning run's groups (bench/shared_prefix.py's defaults)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=136)
    parser.add_argument("--micro-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.role == "trainer":
        trainer_role(args)
        return
    splits = [s for s in args.splits.split(",") if s]
    unknown = set(splits) - set(SPLITS)
    if unknown:
        parser.error(f"unknown splits {sorted(unknown)}; choose from {', '.join(SPLITS)}")
    counts = {len(_cores())} | {n for s in splits for n in _split_threads(s)[:2]}
    results: dict[str, Any] = {"cores": len(_cores()), "dtype": args.dtype,
                               "batch": args.batch, "engine_alone_tokens_per_s": {},
                               "trainer_alone_step_s": {}}  # fmt: skip
    for threads in sorted(counts, reverse=True):
        results["engine_alone_tokens_per_s"][threads] = _engine_alone(args, threads)
        results["trainer_alone_step_s"][threads] = _trainer_step_s(
            _run_trainer(args, threads, None))
        print(f"alone, {threads} threads:", results["engine_alone_tokens_per_s"][threads],
              "tokens/s;", results["trainer_alone_step_s"][threads], "s a step", flush=True)
    full = len(_cores())
    engine_full = results["engine_alone_tokens_per_s"].get(full)
    trainer_full = results["trainer_alone_step_s"].get(full)
    for split in splits:
        got = _together(args, split)
        if engine_full and trainer_full:
            got["engine_fraction"] = round(got["engine_tokens_per_s"] / engine_full, 3)
            got["trainer_fraction"] = round(trainer_full / got["trainer_step_s"], 3)
            got["sum_of_fractions"] = round(got["engine_fraction"] + got["trainer_fraction"], 3)
        results[split] = got
        print(split, json.dumps(got), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
