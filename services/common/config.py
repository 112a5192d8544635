"""Config plumbing every service shares: strict models, the TOML file, overrides, errors.

Each service owns its section's model (services/<svc>/config.py); the whole deployment is
assembled above the services, in services/deployment.py.
"""

from __future__ import annotations

import ssl
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.errors import ConfigError, quote
from services.common.event_loop import EventLoopName


class StrictModel(BaseModel):
    """A config model that rejects unknown keys and NaN or infinite numbers, and re-validates
    on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ServiceConfig(StrictModel):
    """Where a service listens: gRPC for its peers, HTTP for admin REST and metrics."""

    host: str = Field("127.0.0.1", description="address peers use to reach this service")
    bind_host: str | None = Field(None, description="interface to listen on (default: host)")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    admin_port: int = Field(0, ge=0, le=65535, description="admin REST port (0: a free one)")
    event_loop: EventLoopName = Field(
        "asyncio", description="the service's event loop: asyncio, or uvloop (less CPU per "
        "socket event)")

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"


class EventsConfig(StrictModel):
    """The run's events streams (phase spans and per-sample detail, for the dashboard)."""

    enabled: bool = Field(True, description="publish events; off costs nothing at all")
    max_len: int = Field(200_000, ge=100, le=100_000_000,
                         description="approximate cap of riptide:<run>:events (XADD MAXLEN ~)")
    episodes_max_len: int = Field(
        2000, ge=10, le=1_000_000,
        description="approximate cap of riptide:<run>:episodes (per-sample detail)")
    queue_size: int = Field(
        10_000, ge=1, le=10_000_000,
        description="events a process holds while Redis is slow; beyond it they are dropped")


class TrackingConfig(StrictModel):
    """Live export of the run's metrics to TensorBoard and Weights & Biases by `riptide up`,
    read from the events stream (off unless a target is set; needs the `tracking` extra)."""

    tensorboard_dir: str | None = Field(
        None, min_length=1, description="write TensorBoard event files into this folder")
    wandb_project: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$",
        description="log to this Weights & Biases project")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes the run's files only (no network; `wandb sync` "
                               "uploads them later); online needs a W&B login")
    wandb_dir: str | None = Field(
        None, min_length=1, description="where W&B keeps its run files (default: the run "
                                        "directory)")

    @property
    def enabled(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb_project is not None


class TlsFiles(StrictModel):
    """A certificate for the cluster's nodes, its key, and the CA clients verify it with
    (`riptide tls-cert` makes all three)."""

    cert_file: str = Field(min_length=1, description="PEM certificate every service serves "
                                                     "(the nodes' names in subjectAltName)")
    key_file: str = Field(min_length=1, description="PEM private key of cert_file (mode 0600)")
    ca_file: str = Field(min_length=1, description="PEM CA certificate clients verify the "
                                                   "services with")


class GrpcTlsConfig(TlsFiles):
    """TLS of every gRPC port: one certificate for the cluster's nodes and the CA its clients
    verify it with (`riptide tls-cert` makes both)."""


class HttpTlsConfig(TlsFiles):
    """TLS of the services' HTTP listeners: every admin REST port (admin routes, dashboard,
    /metrics, /readyz) and the router's HTTP front (may be the same files as run.grpc_tls)."""


class RunConfig(StrictModel):
    """Deployment-wide settings."""

    name: str = Field("local", pattern=r"^[A-Za-z0-9_.-]+$", description="run name in Redis keys")
    admin_token: str = Field(min_length=8, description="bearer token for every /admin/ route")
    grpc_token: str | None = Field(
        None, min_length=8, description="shared token every gRPC call must carry (all but "
        "health checks); `riptide up` generates one")
    engine_api_key: str | None = Field(
        None, min_length=8, description="bearer key of every engine's HTTP API (SGLang's "
        "--api-key): the fleet starts its engines with it and the rollout, router and trainer "
        "send it; the router's HTTP front wants it of its clients, as sglang-router's --api-key;"
        " `riptide up` generates one")
    grpc_tls: GrpcTlsConfig | None = Field(
        None, description="TLS of the services' gRPC ports (None: plaintext, the token only)")
    http_tls: HttpTlsConfig | None = Field(
        None, description="TLS of the admin REST ports and the router's HTTP front (None: "
        "plain HTTP, the bearer tokens only)")
    admin_max_body_kb: int = Field(
        1024, ge=1, le=1 << 20, description="largest admin REST request body (413 above)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="")
    log_format: Literal["json", "text"] = Field("json", description="structured or human logs")
    events: EventsConfig = Field(default_factory=lambda: EventsConfig(),
                                 description="the dashboard's events streams")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(),
                                     description="metrics export to TensorBoard / W&B")

    def admin_url(self, section: ServiceConfig) -> str:
        """A service's admin REST base URL: https where http_tls is set."""
        return f"{'https' if self.http_tls else 'http'}://{section.host}:{section.admin_port}"

    @property
    def http_verify(self) -> ssl.SSLContext | bool:
        """What HTTP clients verify the services' certificates with (httpx's `verify`)."""
        from services.common.tls import client_context

        return client_context(self.http_tls) if self.http_tls else True

    @model_validator(mode="after")
    def _tracking_reads_events(self) -> RunConfig:
        if self.tracking.enabled and not self.events.enabled:
            raise ValueError("run.tracking exports the metrics of the events stream: set "
                             "run.events.enabled = true, or unset run.tracking.tensorboard_dir "
                             "and run.tracking.wandb_project")
        return self


class RedisConfig(StrictModel):
    """The sample buffer between generation and training, and how every client reaches it:
    an ACL user and its password (the deployment's secret), optionally over TLS."""

    url: str = Field("redis://127.0.0.1:6379/0",
                     description="redis:// (or rediss://, TLS) URL of the buffer, without "
                                 "credentials")
    max_groups: int = Field(1024, ge=1, description="stream capacity; producers wait when full")
    connect_timeout_s: float = Field(5.0, gt=0, description="fail fast when Redis is down")
    username: str = Field("riptide", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                          description="ACL user every client logs in as")
    password: str | None = Field(
        None, min_length=16, max_length=512, pattern=r"^[!-~]+$", repr=False,
        description="the ACL user's password (a secret: best set through "
                    "RIPTIDE_REDIS_PASSWORD); `riptide up` generates one; required to start "
                    "Redis")
    tls_ca_file: str | None = Field(
        None, min_length=1, description="rediss://: CA certificate file clients verify the "
                                        "server with (None: the system's CAs)")
    tls_cert_file: str | None = Field(
        None, min_length=1, description="rediss://: certificate of the Redis Riptide starts")
    tls_key_file: str | None = Field(
        None, min_length=1, description="rediss://: private key of that certificate (mode 0600)")

    @model_validator(mode="after")
    def _check_url(self) -> RedisConfig:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError(f"url {self.url!r}: expected redis://host:port/db or "
                             "rediss://host:port/db")
        if parts.username or parts.password:
            raise ValueError("url holds credentials: drop them from the URL and set "
                             "redis.username, and redis.password (or RIPTIDE_REDIS_PASSWORD)")
        tls_files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if parts.scheme == "redis" and any(tls_files):
            raise ValueError("redis.tls_* files are for TLS: use a rediss:// url, or unset them")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set redis.tls_cert_file and redis.tls_key_file together")
        return self

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 6379

    def describe(self) -> str:
        """What a client uses, for messages: the URL, the user, whether a password is set."""
        login = f"user {self.username}, password set" if self.password else "no password"
        return f"{self.url} ({login}{', TLS' if self.tls else ''})"


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse `section.key=value`; the value is read as TOML, else taken as a plain string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def override_tree(items: list[str]) -> dict[str, Any]:
    """`section.key=value` overrides as nested tables (for `deep_merge`)."""
    data: dict[str, Any] = {}
    for item in items:
        keys, value = parse_override(item)
        _apply(data, keys, value)
    return data


def _apply(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


def deep_merge(base: dict[str, Any], overrides: dict[str, Any], path: str = "") -> dict[str, Any]:
    """`base` with `overrides` merged in, tables key by key at every depth (neither is
    modified): `{"a": {"b": {"c": 1}}}` changes `a.b.c` and keeps every sibling of it. A table
    given where the base holds a plain value (or the reverse) is an error naming the key."""
    merged = dict(base)
    for key, value in overrides.items():
        where = f"{path}.{key}" if path else str(key)
        current = merged.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            merged[key] = deep_merge(current, value, where)
        elif isinstance(value, dict) != isinstance(current, dict) and current is not None:
            kind = "a table" if isinstance(current, dict) else "a value"
            raise ConfigError(f"override {where}: the config holds {kind} there")
        else:
            merged[key] = value
    return merged


def format_validation_error(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: invalid config"]
    for err in exc.errors()[:10]:
        where = ".".join(quote(p, 40) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {quote(err['msg'], 200)}")
    return "\n".join(lines)


def read_config_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a deployment TOML file into a dict and apply `section.key=value` overrides."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides or []:
        keys, value = parse_override(item)
        _apply(data, keys, value)
    return data


def validate_section(model: type[StrictModel], values: dict[str, Any], source: str) -> Any:
    """Validate one section's values into its model, or raise a precise ConfigError."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc)) from None


def dump_config(config: BaseModel) -> str:
    """Render a config as TOML: a table per section and sub-section; None values left out."""
    out: list[str] = []
    _dump_table(config.model_dump(mode="json", exclude_none=True), [], out)
    return "\n".join(out)


def _dump_table(values: dict[str, Any], path: list[str], out: list[str]) -> None:
    scalars = {k: v for k, v in values.items() if not isinstance(v, dict)}
    if path and (scalars or not values):
        out.append(f"[{'.'.join(path)}]")
    out.extend(f"{key} = {_toml_value(val)}" for key, val in scalars.items())
    if path and scalars:
        out.append("")
    for key, val in values.items():
        if isinstance(val, dict):
            _dump_table(val, [*path, key], out)


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {value!r} as TOML")
