"""The bodies of `riptide eval` and `riptide tasks check`.

`riptide eval` scores a task folder with a model: it starts a built-in engine on the weights
(a model folder, or a trainer checkpoint exported beside its base model) and runs real
episodes (services/sandbox/evaluate.py); its settings come from eval_settings.py (flags, a
run's config, defaults). `riptide eval --scripted oracle|noop` and `riptide tasks check` run
no model: the scripted policies of services/sandbox/task_check.py validate a task folder.
Each prints human lines first and one JSON line last; a failed check exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

from services.eval_settings import EvalSettings, resolve


def run_eval(args: argparse.Namespace) -> int:
    """`riptide eval`: a model's per-task and mean success (or a scripted policy's check)."""
    settings = resolve(args)  # bad settings and malformed folders fail before anything starts
    if args.scripted is not None:
        return _print_scripted(settings, [args.scripted], args.concurrency)
    from services.common.engine_launch import running_engine
    from services.sandbox.chat_format import ChatFormat
    from services.sandbox.engine_model_client import EngineModelClient
    from services.sandbox.evaluate import evaluate
    from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
    from services.sandbox.server import load_tokenizer

    model_dir = _model_dir(settings, args.dir)
    key = secrets.token_urlsafe(24)  # the engine answers this process only
    with running_engine(model_dir, args.dir / "engine.log", extra_args=settings.engine_args,
                        api_key=key) as url:
        async def run() -> dict[str, object]:
            model = EngineModelClient(url, api_key=key)
            provider = LocalProvider(LocalProviderConfig())
            chat = ChatFormat(load_tokenizer(str(model_dir)))
            try:
                result = await evaluate(
                    settings.tasks, model, chat, provider, settings.agent,
                    num_samples=settings.num_samples, greedy=settings.greedy,
                    temperature=settings.temperature, max_concurrent_episodes=args.concurrency)
                if args.also_sampled:  # the same engine, no second start
                    sampled = await evaluate(
                        settings.tasks, model, chat, provider, settings.agent,
                        num_samples=args.also_sampled, greedy=False,
                        temperature=settings.temperature,
                        max_concurrent_episodes=args.concurrency)
                    result["sampled"] = {"samples": args.also_sampled,
                                         "temperature": settings.temperature, **sampled}
                return result
            finally:
                await model.close()
                await provider.close()

        result = asyncio.run(run())
    extra: dict[str, Any] = {"run": settings.run} if settings.run else {}
    print(json.dumps({"checkpoint": str(settings.checkpoint or model_dir), **extra,
                      "engine_args": settings.engine_args, "max_turns": settings.agent.max_turns,
                      "max_new_tokens": settings.agent.max_new_tokens, **result}))
    return 0


def run_tasks_check(args: argparse.Namespace) -> int:
    """`riptide tasks check DIR`: the layout of every task, then (when it holds) each task's
    oracle (reward 1) and no-op (reward 0) in a real local sandbox."""
    from services.sandbox.task import TaskSet
    from services.sandbox.task_check import layout_problems

    tasks, problems = layout_problems(args.dir)
    for problem in problems:
        print(f"[check] {problem}", flush=True)
    if problems:
        print(json.dumps({"tasks_check": {"layout_ok": False, "problems": problems}}))
        return 1
    print(f"[check] layout: {len(tasks)} tasks in {args.dir}", flush=True)
    if args.layout_only:
        print(json.dumps({"tasks_check": {"layout_ok": True, "num_tasks": len(tasks)}}))
        return 0
    from services.sandbox.task_check import scripted_agent

    settings = EvalSettings(tasks=TaskSet(tasks), agent=scripted_agent(args.protocol),
                            num_samples=1, greedy=True, temperature=0.0, engine_args=[],
                            checkpoint=None, base=None, run={})
    return _print_scripted(settings, ["oracle", "noop"], args.concurrency, "tasks_check")


def _print_scripted(settings: EvalSettings, policies: list[str], concurrency: int,
                    key: str = "scripted") -> int:
    """Run each scripted policy over the tasks; a line per task, then the JSON; 1 if wrong."""
    from services.common.tiny_model import build_tokenizer
    from services.sandbox.chat_format import ChatFormat
    from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
    from services.sandbox.task_check import scripted_agent, scripted_rewards

    agent = scripted_agent(settings.agent.protocol)
    chat = ChatFormat(build_tokenizer())

    async def run() -> dict[str, dict[str, Any]]:
        provider = LocalProvider(LocalProviderConfig())
        try:
            return {policy: await scripted_rewards(settings.tasks, policy, provider, chat, agent,
                                                   concurrency) for policy in policies}
        finally:
            await provider.close()

    results = asyncio.run(run())
    width = max(len(name) for name in settings.tasks.names)
    print(f"[check] {'task':<{width}}  " + "  ".join(f"{p:>6}" for p in policies), flush=True)
    for name in settings.tasks.names:
        entries = [results[p]["tasks"][name] for p in policies]
        cells = "  ".join(f"{_reward(e):>6}" for e in entries)
        wrong = [f"{p} should score {e['expected']:g}" for p, e in zip(policies, entries,
                                                                        strict=True)
                 if not e["ok"]]
        print(f"[check] {name:<{width}}  {cells}  {'; '.join(wrong) if wrong else 'ok'}",
              flush=True)
    ok = all(r["ok"] for r in results.values())
    print(json.dumps({key: {"ok": ok, **{p: {t: {"reward": e["rewards"][0], "ok": e["ok"],
                                                 "finish_reason": e["finish_reasons"][0]}
                                             for t, e in r["tasks"].items()}
                                         for p, r in results.items()}}}))
    return 0 if ok else 1


def _reward(entry: dict[str, Any]) -> str:
    return "none" if entry["no_verdict"] else f"{entry['rewards'][0]:g}"


def _model_dir(settings: EvalSettings, work_dir: Path) -> Path:
    """The Hugging Face folder to serve: given, exported from a trainer checkpoint, or tiny."""
    from services.common.errors import ConfigError

    checkpoint = settings.checkpoint
    if checkpoint is None:
        from services.local_stack import ensure_tiny_model

        return ensure_tiny_model(work_dir)
    if (checkpoint / "config.json").is_file():
        return Path(checkpoint)
    if not checkpoint.is_dir():
        raise ConfigError(f"{checkpoint}: no such checkpoint or model folder")
    if settings.base is None:
        raise ConfigError(f"{checkpoint} is a trainer checkpoint (no config.json): "
                          "--base must name the model folder it was trained from")
    from services.trainer.weights.export import export_checkpoint

    return export_checkpoint(checkpoint, settings.base, work_dir / "exported")
