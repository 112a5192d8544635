"""The Dockerfile reader: WORKDIR, ENV and COPY/ADD as Docker resolves them."""

from __future__ import annotations

from services.sandbox.dockerfile import parse_dockerfile


def test_workdir_env_and_copies() -> None:
    facts = parse_dockerfile(
        "# comment\nFROM python:3.13-slim AS base\nWORKDIR /app\n"
        'ENV A=1 B="two words"\nENV C 3\n'
        "COPY setup.sh ./\nCOPY --chown=1000:1000 resources /app/resources\n"
        "RUN apt-get update && \\\n    apt-get install -y git\n"
        "COPY a.txt b.txt /data\nCOPY --from=base /x /y\nADD app/ /app/\n"
        "WORKDIR personal-site\n"
    )
    assert facts.base_image == "python:3.13-slim"
    assert facts.workdir == "/app/personal-site"
    assert facts.env == {"A": "1", "B": "two words", "C": "3"}
    assert facts.run_lines == (8,)
    got = [(c.sources, c.dest, c.dest_is_dir, c.line) for c in facts.copies]
    assert got == [
        (("setup.sh",), "/app", True, 6),
        (("resources",), "/app/resources", False, 7),
        (("a.txt", "b.txt"), "/data", True, 10),
        (("app/",), "/app", True, 12),
    ]


def test_no_workdir_defaults_to_root() -> None:
    assert parse_dockerfile("FROM ubuntu\n").workdir == "/"
