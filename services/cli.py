"""The `riptide` command: serve one service, run the local stack, show a stack's state.

Config is parsed and validated before any heavy module is imported, so `--help` and config
errors are instant and the router never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path

from services.common.errors import RiptideError

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
    up.add_argument("--dir", type=Path, default=DEFAULT_RUN_DIR,
                    help="run directory: config, logs, checkpoints (default .riptide)")
    up.add_argument("--config", type=Path, default=None,
                    help="use this config instead of writing a fresh local one")
    up.add_argument("--steps", type=int, default=None,
                    help="stop after the trainer finished this many steps, with a summary")

    status = sub.add_parser("status", help="print the state of a running stack")
    status.add_argument("--config", type=Path, default=DEFAULT_RUN_DIR / "config.toml")
    status.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, as for serve (e.g. run.admin_token)")
    status.add_argument("--json", action="store_true", help="print raw JSON")

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("create-tiny", help="write a tiny random model (no download)")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
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
        serve_engine(config.engine)
        return 0
    if args.service == "trainer" and config.trainer.parallel.launcher == "external":
        from services.trainer.rank_env import launched_rank

        me = launched_rank()
        if me.rank != 0:  # only rank 0 serves; the others follow its commands
            from services.trainer.worker import serve_launched_rank

            serve_launched_rank(config.trainer, me)
            return 0
    from services.common.serve import serve

    server = importlib.import_module(f"services.{args.service}.server")

    async def main() -> None:
        # Built inside the loop: gRPC channels and tasks a runtime creates belong to it.
        runtime = server.build_runtime(config)
        await serve(runtime, getattr(config, args.service), config.run)

    asyncio.run(main())
    return 0


def _up(args: argparse.Namespace) -> int:
    from services.common.run_summary import summarize
    from services.local_stack import run_up

    return run_up(args.dir, args.config, args.steps, summarize)


def _status(args: argparse.Namespace) -> int:
    import json

    from services.common import status_report
    from services.deployment import load_config

    report = status_report.collect(load_config(args.config, list(args.set)))
    print(json.dumps(report, indent=2) if args.json else status_report.render(report))
    return 0 if all(s.get("state") not in ("unreachable", "error") for s in report.values()) else 1


def _model(args: argparse.Namespace) -> int:
    from services.common.tiny_model import create_tiny_model

    create_tiny_model(args.path, seed=args.seed)
    print(f"tiny model written to {args.path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"serve": _serve, "up": _up, "status": _status, "model": _model}
    try:
        return handlers[args.command](args)
    except RiptideError as exc:
        print(f"riptide: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
