"""`python -m services.engine`: parse flags (and an optional deployment file) into an
EngineConfig first, then load the model and serve. `riptide serve engine` calls `main`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from services.common.engine_contract import API_KEY_ENV
from services.engine.config import EngineConfig

# flag -> EngineConfig field; SGLang's spellings are accepted as aliases.
_FLAGS: dict[str, tuple[str, ...]] = {
    "model_path": ("--model", "--model-path"),
    "tokenizer_path": ("--tokenizer-path",),
    "host": ("--host",),
    "port": ("--port",),
    "api_key": ("--api-key",),
    "dp_size": ("--dp-size", "--dp"),
    "max_running_requests": ("--max-running-requests",),
    "max_total_num_tokens": ("--max-total-tokens", "--max-total-num-tokens"),
    "prefix_cache_num_tokens": ("--prefix-cache-num-tokens",),
    "max_context_len": ("--context-length",),
    "device": ("--device",),
    "dtype": ("--dtype",),
    "attn_implementation": ("--attn-implementation",),
    "decode_backend": ("--decode-backend",),
    "num_threads": ("--num-threads",),
    "weight_version": ("--weight-version",),
    "served_model_name": ("--served-model-name",),
    "random_seed": ("--random-seed",),
    "weight_update_timeout_s": ("--weight-update-timeout-s",),
    "contract": ("--contract",),
    "log_level": ("--log-level",),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.engine",
        description="Riptide's built-in SGLang-compatible inference engine.",
    )
    parser.add_argument("--config", help="deployment TOML file; its [engine] section is read")
    parser.add_argument("--ready-file", help="write the bound port here once serving")
    for field, flags in _FLAGS.items():
        info = EngineConfig.model_fields[field]
        parser.add_argument(*flags, dest=field, default=None, help=info.description)
    info = EngineConfig.model_fields["enable_return_routed_experts"]
    parser.add_argument("--enable-return-routed-experts", dest="enable_return_routed_experts",
                        action="store_const", const=True, default=None, help=info.description)
    parser.add_argument("--disable-cuda-graph", dest="cuda_graph", action="store_const",
                        const=False, default=None, help="decode without CUDA graphs (as SGLang)")
    parser.add_argument("--no-flat-weights", dest="flat_weights", action="store_const",
                        const=False, default=None,
                        help=EngineConfig.model_fields["flat_weights"].description)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, str | None]:
    """(config, ready file); flags override --config's [engine] section and the defaults."""
    args = build_parser().parse_args(argv)
    from services.common.config import read_config_file, validate_section
    from services.common.errors import ConfigError

    values: dict = {}
    if args.config:
        values = dict(read_config_file(args.config).get("engine", {}))
        validate_section(EngineConfig, values, f"{args.config} [engine]")
    if os.environ.get(API_KEY_ENV):  # a launcher's way: not on the command line
        values["api_key"] = os.environ[API_KEY_ENV]
    flags = [*_FLAGS, "enable_return_routed_experts"]
    values.update({f: getattr(args, f) for f in flags if getattr(args, f) is not None})
    if args.cuda_graph is not None:
        values["cuda_graph"] = args.cuda_graph
    config = validate_section(EngineConfig, values, "engine")
    if not config.model_path:
        raise ConfigError("engine: --model (or engine.model_path) is required")
    return config, args.ready_file


def serve(config: EngineConfig, ready_file: str | None = None) -> None:
    """Load the model and serve the HTTP API until SIGINT/SIGTERM."""
    import socket
    from pathlib import Path

    import uvicorn

    from services.engine.engine import Engine
    from services.engine.http_server import create_app

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = Engine(config)
    engine.start()
    app = create_app(engine)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    port = sock.getsockname()[1]
    logging.getLogger(__name__).info("engine serving on http://%s:%d", config.host, port)
    if ready_file:
        Path(ready_file).write_text(str(port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        app.state.updater.destroy_all()


def main(argv: list[str] | None = None) -> int:
    from services.common.errors import ConfigError

    try:
        config, ready_file = parse_args(argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    serve(config, ready_file)
    return 0
