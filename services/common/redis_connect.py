"""Every Redis client of Riptide is made here, from the deployment's [redis] section: its URL,
its ACL user and password (the secret never travels inside the URL, so no message or log line
that names the URL can leak it) and, for rediss://, the CA file the server is verified with.

Called by the sample buffer, the events publisher and tail, the dashboard, `riptide up`,
`riptide events export`, benches and test helpers.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio

from services.common.config import RedisConfig
from services.common.errors import RiptideError, Unauthenticated, Unavailable


def redis_options(config: RedisConfig) -> dict[str, Any]:
    """Keyword arguments of redis-py's clients that carry the credentials and TLS settings."""
    options: dict[str, Any] = {}
    if config.password is not None:
        options.update(username=config.username, password=config.password)
    if config.tls and config.tls_ca_file is not None:  # rediss:// verifies the server
        options["ssl_ca_certs"] = config.tls_ca_file
    return options


def connect(config: RedisConfig, **options: Any) -> redis.Redis:
    """A synchronous client of the configured Redis (connects on first use)."""
    return redis.Redis.from_url(config.url, **redis_options(config), **options)


def connect_async(config: RedisConfig, **options: Any) -> redis.asyncio.Redis:
    """An asyncio client of the configured Redis (connects on first use)."""
    return redis.asyncio.Redis.from_url(config.url, **redis_options(config), **options)


def redis_failure(exc: redis.RedisError, config: RedisConfig, doing: str) -> RiptideError:
    """The error to raise for a failed Redis call: a refused login says how to provide the
    password (retrying cannot help), anything else that Redis is unavailable."""
    if isinstance(exc, redis.AuthenticationError):
        return Unauthenticated(
            f"cannot {doing}: Redis at {config.url} refused user {config.username!r} ({exc}); "
            "give the deployment's password in RIPTIDE_REDIS_PASSWORD (or redis.password)")
    return Unavailable(f"cannot {doing}: Redis at {config.url}: {exc}")


def pings(config: RedisConfig, timeout_s: float = 0.5) -> bool:
    """Whether the configured Redis answers PING with these credentials."""
    try:
        with connect(config, socket_connect_timeout=timeout_s, socket_timeout=timeout_s) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False
