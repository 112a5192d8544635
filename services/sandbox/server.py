"""Entry point of `riptide serve sandbox`: build the sandbox service from the deployment config.

Imports the heavy parts (tokenizer, provider SDKs) only here, after the config is valid.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.common.service import ServiceRuntime


def load_tokenizer(path: str | None) -> Any:
    """A Hugging Face tokenizer folder, or the tiny model's byte-level tokenizer when None."""
    if path is None:
        from services.common.tiny_model import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"sandbox.tokenizer_path: {path} is not a directory")
    return AutoTokenizer.from_pretrained(path)


def gateway_model_client(deployment_config: Any, model: Any) -> Any:
    """How the gateway reaches the router: its SGLang-compatible HTTP front where one is served
    on a known port (less per call than gRPC), else `model`, the service's Router.Generate
    client (also what a scripted run uses)."""
    router = deployment_config.router
    if deployment_config.sandbox.model_client != "router" or not router.http_port:
        return model
    from services.common.tls import client_context
    from services.sandbox.engine_model_client import EngineModelClient

    tls = deployment_config.run.http_tls
    return EngineModelClient(f"{'https' if tls else 'http'}://{router.host}:{router.http_port}",
                             deployment_config.sandbox.generate_timeout_s,
                             deployment_config.run.engine_api_key, routed=True,
                             ssl_context=client_context(tls) if tls else None)


def build_runtime(deployment_config: Any) -> ServiceRuntime:
    """The sandbox ServiceRuntime for this deployment."""
    from services.common.events import EventPublisher
    from services.sandbox.agent import EpisodeAgent, TerminalAgent
    from services.sandbox.chat_format import ChatFormat
    from services.sandbox.episode import EpisodeRunner
    from services.sandbox.leases import Leases, Owner, new_incarnation
    from services.sandbox.model_client import ModelClient, RouterModelClient, ScriptedModelClient
    from services.sandbox.provider import make_provider
    from services.sandbox.reaper import Reaper
    from services.sandbox.scripted_policy import scripted_turns
    from services.sandbox.service import SandboxService
    from services.sandbox.stats import SandboxStats
    from services.sandbox.task import Task, TaskSet

    config = deployment_config.sandbox
    tasks = TaskSet.load(config.tasks_dir)
    chat = ChatFormat(load_tokenizer(config.tokenizer_path))
    scripts: dict[str, list[str]] = {}
    script_maker = None
    model: ModelClient
    if config.model_client == "scripted":
        model = ScriptedModelClient(chat, lambda key: scripts.get(key, []))
        scripted = config.scripted

        def script_maker(task: Task) -> list[str]:
            return scripted_turns(task, scripted.policy, scripted.num_extra_commands,
                                  scripted.command_timeout_s, config.agent)
    else:
        address = config.router_address or deployment_config.router.grpc_address
        model = RouterModelClient(address, deployment_config.run.grpc_token,
                                  config.generate_timeout_s, tls=deployment_config.run.grpc_tls)
    provider = make_provider(config.provider)
    stats = SandboxStats()
    incarnation = new_incarnation()
    owner = Owner(deployment_config.run.name, instance_name(config, incarnation), incarnation)
    leases = Leases(provider, owner, config.lease_s, config.lease_create_grace_s)
    events = EventPublisher(deployment_config.redis, deployment_config.run.name, "sandbox",
                            deployment_config.run.events)
    gateway = None
    if config.gateway_enabled:
        from services.sandbox.gateway.server import AgentGateway

        gateway_model = gateway_model_client(deployment_config, model)
        gateway = AgentGateway(gateway_model, chat.tokenizer, config.gateway.model_name,
                               config.gateway.host, config.gateway.port,
                               config.gateway.max_body_kb * 1024,
                               owns_model=gateway_model is not model)
    agent: EpisodeAgent = TerminalAgent(model, chat, provider, config.agent)
    if config.agent.harness != "builtin":
        from services.sandbox.harness import make_harness
        from services.sandbox.harness_agent import HarnessAgent

        assert gateway is not None  # the config validator requires it
        agent = HarnessAgent(make_harness(config.agent.harness), gateway, provider, config.agent)
    runner = EpisodeRunner(provider, agent, stats,
                           config.max_concurrent_episodes, config.max_concurrent_creates,
                           deployment_config.run.name, config.delete_timeout_s, events, leases)
    reaper = Reaper(provider, leases, runner.live.episode_ids, config.delete_timeout_s, events)
    return SandboxService(config, tasks, provider, model, runner, stats, scripts, script_maker,
                          reaper, gateway)


def instance_name(config: Any, incarnation: str) -> str:
    """This service's stable name in its sandboxes' labels: a restart on the same host and
    admin port is the same instance (the port is bound before the reaper's first sweep, so a
    live predecessor would have stopped this process); with a free port (0), no
    predecessor can be recognized and the name is unique to this process."""
    if config.instance_name:
        return str(config.instance_name)
    host = socket.gethostname()
    return f"{host}:{config.admin_port}" if config.admin_port else f"{host}:{incarnation}"
