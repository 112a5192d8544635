"""SSL contexts of the services' HTTP listeners and their clients (run.http_tls): TLS 1.2 or
later, the deployment's own CA only; a file that cannot be read is a ConfigError naming its key.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from services.common.errors import ConfigError

if TYPE_CHECKING:
    from services.common.config import TlsFiles


def server_context(tls: TlsFiles, where: str = "run.http_tls") -> ssl.SSLContext:
    """What a listener serves: the certificate and its key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}.cert_file / key_file: cannot load {tls.cert_file} with "
                          f"{tls.key_file}: {exc}") from None
    return context


def client_context(tls: TlsFiles, where: str = "run.http_tls") -> ssl.SSLContext:
    """What a client trusts: the deployment's CA, and nothing else; host names checked."""
    try:
        context = ssl.create_default_context(cafile=tls.ca_file)  # that CA only, no system's
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}.ca_file: cannot load {tls.ca_file}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
