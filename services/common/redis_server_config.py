"""The configuration of every redis-server Riptide starts (local stack, compose, Slurm): one
ACL user with the deployment's password and the default user switched off, protected mode on,
bound to the addresses the caller names, optionally TLS only. The file is written mode 0600
and holds only the password's SHA-256, so the secret is on no command line and in no file
but the deployment's own.

Called by `riptide up` (services/local_stack.py) and by `riptide redis-server`, the command
compose's and Slurm's Redis run.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal

from services.common.config import RedisConfig
from services.common.errors import ConfigError

#: What the ACL user may do: every data command, no server administration (CONFIG, DEBUG,
#: SHUTDOWN, REPLICAOF, ACL changes, ...).
USER_COMMANDS = "~* &* +@all -@admin"
CONFIG_NAME = "redis.conf"


def server_config(config: RedisConfig, bind: list[str], data_dir: Path,
                  appendfsync: Literal["always", "everysec"] = "everysec",
                  user_commands: str = USER_COMMANDS) -> str:
    """The text of redis.conf for the deployment's Redis, listening on `bind` at the url's
    port, its append-only file in `data_dir`."""
    if not config.password:
        raise ConfigError("Redis always requires authentication: set redis.password (or "
                          "RIPTIDE_REDIS_PASSWORD), e.g. to the output of "
                          "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if not bind:
        raise ConfigError("redis-server needs at least one address to bind")
    digest = hashlib.sha256(config.password.encode()).hexdigest()
    lines = [
        "# Written by Riptide from the deployment's [redis] section; regenerated at each start.",
        f"bind {' '.join(bind)}",
        "protected-mode yes",
        f"dir {_quote(str(data_dir))}",
        'save ""',
        "appendonly yes",
        f"appendfsync {appendfsync}",
        # Nobody can log in as `default` (off, no password), but it keeps the rights of the
        # ACL user: Redis 7.0 replays MULTI/EXEC of the append-only file as that user.
        f"user default off resetpass {user_commands}",
        f"user {config.username} on #{digest} {user_commands}",
    ]
    if config.tls:
        if config.tls_cert_file is None or config.tls_key_file is None:
            raise ConfigError("a rediss:// url needs redis.tls_cert_file and redis.tls_key_file "
                              "for the Redis Riptide starts")
        lines += ["port 0", f"tls-port {config.port}",
                  f"tls-cert-file {_quote(config.tls_cert_file)}",
                  f"tls-key-file {_quote(config.tls_key_file)}", "tls-auth-clients no"]
        if config.tls_ca_file is not None:
            lines.append(f"tls-ca-cert-file {_quote(config.tls_ca_file)}")
    else:
        lines.append(f"port {config.port}")
    return "\n".join(lines) + "\n"


def write_server_config(path: Path, text: str) -> Path:
    """Write redis.conf readable by this user only (also when it existed with wider rights)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)
    return path


def describe_server(config: RedisConfig, bind: list[str]) -> str:
    """What the Redis Riptide starts enforces, without the secret (for the plan and `up`)."""
    tls = "TLS only" if config.tls else "no TLS"
    return (f"ACL user {config.username!r} with a password (default user off; no admin "
            f"commands), protected mode on, bound to {', '.join(bind)}, {tls}")


def _quote(value: str) -> str:
    if any(c in value for c in ' "\\\n'):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    return value
