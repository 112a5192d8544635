"""The [sandbox] section of the deployment config, with its provider and agent subsections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.common.config import ServiceConfig, StrictModel
from services.common.event_loop import EventLoopName
from services.sandbox.providers.local import LocalProviderConfig


class DaytonaProviderConfig(StrictModel):
    """Daytona sandboxes through the `daytona` SDK (async client)."""

    type: Literal["daytona"] = Field("daytona", description="provider implementation")
    api_url: str | None = Field(None, description="Daytona API URL (default: $DAYTONA_API_URL "
                                                  "or the Daytona cloud)")
    api_key_env: str = Field("DAYTONA_API_KEY", description="environment variable holding the "
                                                            "API key (never the key itself)")
    target: str | None = Field(None, description="region for sandboxes and snapshots")
    auto_stop_interval_min: int = Field(30, ge=1, description="idle minutes before Daytona "
                                                              "stops a sandbox (orphans die)")
    auto_delete_interval_min: int = Field(0, ge=0, description="minutes a stopped sandbox is "
                                                               "kept before deletion (0: at once)")
    create_timeout_s: float = Field(1800.0, gt=0, description="limit of one create, image "
                                                              "build included")
    num_create_retries: int = Field(6, ge=0, description="retries of a rate-limited create")
    backoff_initial_s: float = Field(1.0, gt=0, description="first retry delay; doubles each time")
    backoff_max_s: float = Field(60.0, gt=0, description="cap of one retry delay")
    image_template: str | None = Field(
        None, description="image of tasks without docker_image, e.g. 'registry/riptide-{task}:v1'"
                          " (default: build the task's Dockerfile)")
    use_snapshots: bool = Field(True, description="build one snapshot per image and create "
                                                  "sandboxes from it")
    snapshot_prefix: str = Field("riptide", pattern=r"^[a-z0-9-]+$",
                                 description="name prefix of the snapshots Riptide builds")
    session_command_min_timeout_s: float = Field(
        30.0, ge=0, description="commands allowed longer than this run as polled session commands")
    session_poll_interval_s: float = Field(0.5, gt=0, description="poll period of session "
                                                                  "commands")
    request_timeout_s: float = Field(60.0, gt=0, description="limit of one control-plane call")


ProviderSection = Annotated[LocalProviderConfig | DaytonaProviderConfig,
                            Field(discriminator="type")]


class AgentConfig(StrictModel):
    """Limits of the terminal agent, per episode."""

    max_turns: int = Field(30, ge=1, description="model turns before the episode stops")
    max_context_tokens: int = Field(32768, ge=64, description="prompt plus response token cap")
    max_new_tokens: int = Field(4096, ge=1, description="per-turn cap when the request sets none")
    wall_time_s: float = Field(1800.0, gt=0, description="agent time cap (the task's own "
                                                         "agent timeout applies too)")
    stop_grace_s: float = Field(60.0, gt=0, description="how long past its wall time an agent "
                                "may take to stop before the episode is an agent timeout")
    default_command_timeout_s: float = Field(30.0, gt=0, description="timeout of a command "
                                                                     "that names none")
    max_command_timeout_s: float = Field(600.0, gt=0, description="cap of one command's timeout")
    max_observation_chars: int = Field(10000, ge=256, description="observation size; head and "
                                                                  "tail kept")
    protocol: Literal["tagged", "markdown_bash", "terminus2"] = Field(
        "tagged", description="reply format: tagged <command> blocks, one markdown bash block "
                              "per turn (mini-swe-agent), or Terminus-2's JSON")
    persistent_shell: bool = Field(
        True, description="one shell per episode: cwd, variables and functions carry over "
                          "between commands (False: each command starts afresh)")
    harness: Literal["builtin", "terminus2", "mini_swe_agent"] = Field(
        "builtin", description="builtin: the protocol above, run by Riptide's own agent; "
                               "terminus2 (Harbor) or mini_swe_agent: that third-party agent, "
                               "unchanged, through the agent gateway")

    @model_validator(mode="after")
    def _timeouts(self) -> AgentConfig:
        if self.default_command_timeout_s > self.max_command_timeout_s:
            raise ValueError("default_command_timeout_s exceeds max_command_timeout_s; "
                             "lower the default or raise the cap")
        return self


class GatewayConfig(StrictModel):
    """The agent gateway: an OpenAI-compatible endpoint per episode for black-box harnesses."""

    enabled: bool | None = Field(
        None, description="serve the gateway (default: when agent.harness is not builtin)")
    host: str = Field("127.0.0.1", description="interface the gateway listens on (harnesses run "
                                               "beside the sandbox service)")
    port: int = Field(0, ge=0, le=65535, description="gateway HTTP port (0 picks a free one)")
    model_name: str = Field("riptide", min_length=1, max_length=128,
                            description="the model name /v1/models lists and answers carry")
    max_body_kb: int = Field(16384, ge=64, le=1 << 20, description="largest request body")


class ScriptedClientConfig(StrictModel):
    """The scripted model client: a test and benchmark tool, never a model."""

    policy: Literal["oracle", "noop"] = Field(
        "oracle", description="oracle: run the task's solution/solve.sh as the only command; "
                              "noop: declare completion at once")
    num_extra_commands: int = Field(0, ge=0, description="harmless commands before the policy's "
                                                         "own (benchmarks)")
    command_timeout_s: float = Field(600.0, gt=0, description="timeout of the scripted commands")


class SandboxConfig(ServiceConfig):
    """Settings of the sandbox service."""

    grpc_port: int = Field(50053, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    admin_port: int = Field(8053, ge=0, le=65535, description="admin REST port (0: a free one)")
    event_loop: EventLoopName = Field(
        "uvloop", description="uvloop (default): less CPU per call for the agent gateway's "
        "hop (bench/gateway.py); asyncio: the standard library's")
    tasks_dir: str = Field("tasks", description="directory of tasks in terminal-bench-2 layout")
    provider: ProviderSection = Field(default_factory=LocalProviderConfig,
                                      description="which sandboxes run episodes")
    max_concurrent_episodes: int = Field(64, ge=1, le=100_000,
                                         description="episodes running at once; "
                                                               "tunable live")
    max_concurrent_creates: int = Field(8, ge=1, le=10_000,
                                        description="sandbox creates in flight at once; "
                                                             "tunable live")
    delete_timeout_s: float = Field(60.0, gt=0, description="limit of one sandbox delete")
    instance_name: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="this service's name in its sandboxes' labels, the same across restarts "
                    "(default host:admin_port; with admin_port 0, unique per process)")
    lease_s: float = Field(600.0, ge=1.0, le=86_400, description="a sandbox's lease: the "
                           "reaper deletes it this long after its service last renewed it")
    lease_renew_interval_s: float = Field(60.0, gt=0, le=3600, description="how often the "
                                          "service renews the leases of its live sandboxes")
    lease_create_grace_s: float = Field(1800.0, ge=0, le=86_400, description="extra lease of "
                                        "a sandbox being created (image builds take long)")
    reap_interval_s: float = Field(60.0, gt=0, le=3600, description="how often the reaper "
                                   "lists the run's sandboxes (also at start-up and stop)")
    model_client: Literal["router", "scripted"] = Field(
        "router", description="router: the real model via Router.Generate; scripted: replayed "
                              "commands (tests and benchmarks only)")
    router_address: str | None = Field(None, description="host:port of the router's gRPC "
                                                         "(default: the [router] section's)")
    generate_timeout_s: float = Field(600.0, gt=0, description="limit of one Generate call")
    tokenizer_path: str | None = Field(None, description="Hugging Face tokenizer folder (default:"
                                                         " the tiny model's byte-level one)")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="agent limits")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig,
                                   description="the OpenAI-compatible agent gateway")
    scripted: ScriptedClientConfig = Field(default_factory=ScriptedClientConfig,
                                           description="scripted client (model_client=scripted)")
    live_snapshot_interval_s: float = Field(
        1.0, ge=0.1, le=60.0, description="how often the live sandboxes are checked; a "
                                          "`sandbox.live` event goes out when they changed")
    live_snapshot_heartbeat_s: float = Field(
        10.0, ge=1.0, le=3600.0, description="a `sandbox.live` event at least this often, "
                                             "changed or not")

    @property
    def gateway_enabled(self) -> bool:
        if self.gateway.enabled is None:
            return self.agent.harness != "builtin"
        return self.gateway.enabled

    @model_validator(mode="after")
    def _harness_needs_gateway(self) -> SandboxConfig:
        if self.agent.harness != "builtin" and self.gateway.enabled is False:
            raise ValueError(f"sandbox.agent.harness = {self.agent.harness!r} reaches the model "
                             "through the gateway: leave sandbox.gateway.enabled unset or true")
        if self.agent.harness != "builtin" and self.model_client == "scripted":
            raise ValueError("the scripted model client replays the built-in protocol: use "
                             "sandbox.agent.harness = 'builtin' with it")
        return self

    @model_validator(mode="after")
    def _renewals_within_lease(self) -> SandboxConfig:
        if self.lease_renew_interval_s * 2 > self.lease_s:
            raise ValueError(f"sandbox.lease_renew_interval_s ({self.lease_renew_interval_s}) "
                             f"must be at most half of lease_s ({self.lease_s}), so that one "
                             "failed renewal does not let a lease lapse: renew more often")
        return self

    @model_validator(mode="after")
    def _heartbeat_after_interval(self) -> SandboxConfig:
        if self.live_snapshot_heartbeat_s < self.live_snapshot_interval_s:
            raise ValueError(f"sandbox.live_snapshot_heartbeat_s "
                             f"({self.live_snapshot_heartbeat_s}) is shorter than "
                             f"live_snapshot_interval_s ({self.live_snapshot_interval_s}): make "
                             "the heartbeat at least the interval")
        return self
