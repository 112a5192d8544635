"""Entry point of `riptide serve sandbox`: build the sandbox service from the deployment config.

Imports the heavy parts (tokenizer, provider SDKs) only here, after the config is valid.
"""

from __future__ import annotations

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


def build_runtime(deployment_config: Any) -> ServiceRuntime:
    """The sandbox ServiceRuntime for this deployment."""
    from services.common.events import EventPublisher
    from services.sandbox.agent import TerminalAgent
    from services.sandbox.chat_format import ChatFormat
    from services.sandbox.episode import EpisodeRunner
    from services.sandbox.model_client import ModelClient, RouterModelClient, ScriptedModelClient
    from services.sandbox.provider import make_provider
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
    runner = EpisodeRunner(provider, TerminalAgent(model, chat, provider, config.agent), stats,
                           config.max_concurrent_episodes, config.max_concurrent_creates,
                           deployment_config.run.name, config.delete_timeout_s,
                           EventPublisher(deployment_config.redis, deployment_config.run.name,
                                          "sandbox", deployment_config.run.events))
    return SandboxService(config, tasks, provider, model, runner, stats, scripts, script_maker)
