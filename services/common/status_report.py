"""`riptide status`: the state of a running deployment, read from each admin endpoint."""

from __future__ import annotations

import json
from typing import Any

import httpx

SERVICES = ("router", "rollout", "sandbox", "trainer")


def collect(config: Any, timeout_s: float = 3.0) -> dict[str, Any]:
    """Each service's /admin/state, or the reason it could not be read."""
    headers = {"Authorization": f"Bearer {config.run.admin_token}"}
    report: dict[str, Any] = {}
    with httpx.Client(timeout=timeout_s, headers=headers, verify=config.run.http_verify) as client:
        for name in SERVICES:
            url = config.run.admin_url(getattr(config, name))
            try:
                resp = client.get(f"{url}/admin/state")
            except httpx.HTTPError as exc:
                report[name] = {"state": "unreachable", "error": f"{url}: {exc}"}
                continue
            if resp.status_code != 200:
                report[name] = {"state": "error", "error": f"{url}: HTTP {resp.status_code}"}
            else:
                report[name] = resp.json()
    return report


def render(report: dict[str, Any]) -> str:
    """A human-readable table: one line per service, then its details."""
    lines = []
    for name, status in report.items():
        uptime = status.get("uptime_s")
        suffix = f"  up {uptime:.0f}s" if isinstance(uptime, (int, float)) else ""
        lines.append(f"{name:<8} {status.get('state', '?'):<12}{suffix}")
        if "error" in status:
            lines.append(f"         {status['error']}")
        for key, value in (status.get("details") or {}).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if len(text) > 100:
                text = text[:97] + "..."
            lines.append(f"         {key}: {text}")
    return "\n".join(lines)
