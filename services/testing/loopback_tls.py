"""A private CA and a certificate for 127.0.0.1 and localhost, as a TLS config section: for
tests of the services' TLS listeners (`riptide tls-cert` makes the same for a cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from services.common.config import TlsFiles
from services.common.tls_cert import make_cluster_certs

T = TypeVar("T", bound=TlsFiles)


def loopback_tls(out: Path, section: type[T]) -> T:
    """Files under `out` (needs the openssl program)."""
    pair = make_cluster_certs(out, ["127.0.0.1", "localhost"])
    return section(cert_file=str(pair.cert_file), key_file=str(pair.key_file),
                   ca_file=str(pair.ca_file))
