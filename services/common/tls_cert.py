"""`riptide tls-cert`: a private CA and one server certificate it signed, for a cluster's TLS
(Redis's rediss://, gRPC): every node's name and address goes in the certificate, every client
trusts the CA. Made with the `openssl` command; the private keys are written mode 0600 in a
folder of mode 0700.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError, Unavailable

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class CertPair:
    """The files `make_cluster_certs` writes."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def subject_alt_names(hosts: list[str]) -> str:
    """`DNS:name` or `IP:address` for each host, as openssl's subjectAltName wants them."""
    if not hosts:
        raise ConfigError("name at least one --host (a node name or address clients dial)")
    names = []
    for host in hosts:
        try:
            names.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            if not host or any(c in host for c in ", \n/"):
                raise ConfigError(f"--host {host!r} is neither a host name nor an address"
                                  ) from None
            names.append(f"DNS:{host}")
    return ",".join(names)


def make_cluster_certs(out: Path, hosts: list[str], days: int = 365) -> CertPair:
    """A CA (ca.pem, ca-key.pem) and a server certificate for `hosts` (server.pem,
    server-key.pem) in `out`; an existing CA there is reused, so servers added later are
    trusted by the clients that already hold ca.pem."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise Unavailable("the openssl command is not on PATH (Debian/Ubuntu: "
                          "`apt-get install openssl`)")
    if days < 1:
        raise ConfigError("--days must be at least 1")
    san = subject_alt_names(hosts)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca, ca_key = out / "ca.pem", out / "ca-key.pem"
    cert, key, csr = out / "server.pem", out / "server-key.pem", out / "server.csr"
    if not ca.exists():
        _run(openssl, "req", "-x509", *EC_KEY, "-keyout", ca_key, "-out", ca, "-days", days,
             "-subj", "/CN=Riptide cluster CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _run(openssl, "req", *EC_KEY, "-keyout", key, "-out", csr, "-subj", f"/CN={hosts[0]}")
    extensions = out / "server.ext"
    extensions.write_text(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                          "keyUsage=critical,digitalSignature,keyEncipherment\n"
                          "extendedKeyUsage=serverAuth,clientAuth\n")
    _run(openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", days, "-extfile", extensions)
    for private in (ca_key, key):
        os.chmod(private, 0o600)
    csr.unlink()
    extensions.unlink()
    return CertPair(ca, cert, key)


def _run(*argv: object) -> None:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise Unavailable(f"openssl {argv[1]} failed: {done.stderr.strip()[-500:]}")
