"""The few Dockerfile facts Riptide needs without Docker: the final WORKDIR, ENV, and COPY/ADD.

The task loader uses the WORKDIR as the default directory of commands; the local provider
builds a sandbox's files from the COPY/ADD instructions (see services/sandbox/README.md).
RUN and everything else is not interpreted.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CopyStep:
    """One COPY/ADD of build-context files: sources relative to the context, an absolute dest."""

    sources: tuple[str, ...]
    dest: str
    line: int
    dest_is_dir: bool


@dataclass(frozen=True)
class DockerfileFacts:
    """What a Dockerfile says about the files and defaults of the sandbox it builds."""

    base_image: str | None = None
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    copies: tuple[CopyStep, ...] = ()
    run_lines: tuple[int, ...] = ()
    """Line numbers of RUN instructions (not executed by the local provider)."""


class DockerfileError(ValueError):
    """A Dockerfile line Riptide cannot read; the message names the line."""


def _logical_lines(text: str) -> list[tuple[int, str]]:
    lines: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append((start, buf + stripped))
        buf = ""
    if buf:
        lines.append((start, buf))
    return lines


def _parse_env(args: str, line: int) -> dict[str, str]:
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: args.split(None, 1)[1] if len(words) > 1 else ""}
    out: dict[str, str] = {}
    for word in words:
        if "=" not in word:
            raise DockerfileError(f"line {line}: ENV expects KEY=VALUE pairs, got {word!r}")
        key, value = word.split("=", 1)
        out[key] = value
    return out


def parse_dockerfile(text: str) -> DockerfileFacts:
    """Parse a Dockerfile's text; raises DockerfileError naming the line it cannot read."""
    base: str | None = None
    workdir = "/"
    env: dict[str, str] = {}
    copies: list[CopyStep] = []
    runs: list[int] = []
    for line, content in _logical_lines(text):
        parts = content.split(None, 1)
        op = parts[0].upper()
        args = parts[1].strip() if len(parts) > 1 else ""
        if op == "FROM":
            base = args.split()[0] if args else None
        elif op == "WORKDIR":
            if not args:
                raise DockerfileError(f"line {line}: WORKDIR needs a path")
            workdir = posixpath.normpath(posixpath.join(workdir, args))
        elif op == "ENV":
            env.update(_parse_env(args, line))
        elif op == "RUN":
            runs.append(line)
        elif op in ("COPY", "ADD"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            if args.lstrip().startswith("["):
                raise DockerfileError(f"line {line}: JSON-form {op} is not supported")
            if len(words) < 2:
                raise DockerfileError(f"line {line}: {op} needs a source and a destination")
            if any(w.startswith("--from") for w in shlex.split(args)):
                continue  # multi-stage copies come from another image, not the context
            *sources, dest = words
            dest_is_dir = dest.endswith("/") or len(sources) > 1 or dest in (".", "./")
            dest = posixpath.normpath(posixpath.join(workdir, dest))
            copies.append(CopyStep(tuple(sources), dest, line, dest_is_dir))
    return DockerfileFacts(base, workdir, env, tuple(copies), tuple(runs))


def read_dockerfile(path: Path) -> DockerfileFacts:
    """Parse the Dockerfile at `path`; errors name the file and the line."""
    try:
        return parse_dockerfile(path.read_text())
    except DockerfileError as exc:
        raise DockerfileError(f"{path}: {exc}") from None
