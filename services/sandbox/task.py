"""Terminal-bench-2 tasks: the loader of one task directory and of a directory of tasks.

A task directory holds `task.toml`, `instruction.md`, `environment/` (a Dockerfile and its
build context), `tests/test.sh` plus its files, and `solution/solve.sh`. Every problem is a
`TaskFormatError` naming the file, the key and what was expected.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.errors import ConfigError, NotFound
from services.sandbox.dockerfile import DockerfileError, DockerfileFacts, read_dockerfile


class TaskFormatError(ConfigError):
    """A task directory does not follow the terminal-bench-2 layout."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_MB_PER_UNIT = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_size_mb(value: object) -> int:
    """'2G' -> 2048, '512M' -> 512, a bare integer is already MB."""
    if isinstance(value, bool):
        raise ValueError("expected a size like '2G' or '512M', got a boolean")
    if isinstance(value, int | float):
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"expected a size like '2G' or '512M', got {value!r}")
    return max(1, int(float(match.group(1)) * _MB_PER_UNIT[match.group(2).upper()]))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskMetadata(BaseModel):
    """Descriptive fields; unknown ones are kept (tasks carry varied metadata)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    author_name: str | None = None
    author_email: str | None = None
    difficulty: str | None = None
    category: str | None = None
    tags: list[str] = Field(default_factory=list)


class VerifierSection(_Section):
    """[verifier]: how `tests/test.sh` runs."""

    timeout_sec: float = Field(600.0, gt=0, description="wall time limit of tests/test.sh")
    env: dict[str, str] = Field(default_factory=dict, description="environment of test.sh")


class AgentSection(_Section):
    """[agent]: the agent's time budget."""

    timeout_sec: float = Field(600.0, gt=0, description="wall time limit of the agent")


class SolutionSection(_Section):
    """[solution]: how `solution/solve.sh` runs."""

    env: dict[str, str] = Field(default_factory=dict, description="environment of solve.sh")


class EnvironmentSection(_Section):
    """[environment]: the image and the resource caps of the sandbox."""

    build_timeout_sec: float = Field(600.0, gt=0, description="image build time limit")
    docker_image: str | None = Field(None, description="prebuilt image (else the Dockerfile)")
    cpus: float = Field(1, gt=0, description="CPU cores")
    memory_mb: int = Field(2048, ge=16, description="memory cap in MiB ('memory' = '2G' too)")
    storage_mb: int = Field(10240, ge=1, description="disk cap in MiB ('storage' = '10G' too)")
    gpus: int = Field(0, ge=0, description="GPUs")
    allow_internet: bool = Field(True, description="whether the sandbox may reach the internet")
    mcp_servers: list[dict[str, Any]] = Field(default_factory=list, description="MCP servers")

    @model_validator(mode="before")
    @classmethod
    def _sizes(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for short, long in (("memory", "memory_mb"), ("storage", "storage_mb")):
            if short in data and long in data:
                raise ValueError(f"give either '{short}' or '{long}', not both")
            if short in data:
                try:
                    data[long] = parse_size_mb(data.pop(short))
                except ValueError as exc:
                    raise ValueError(f"'{short}': {exc}") from None
        return data

    @field_validator("memory_mb", "storage_mb", mode="before")
    @classmethod
    def _mb(cls, value: Any) -> Any:
        return parse_size_mb(value) if isinstance(value, str) else value


class TaskToml(_Section):
    """The whole task.toml."""

    version: str = "1.0"
    task: dict[str, Any] = Field(default_factory=dict)
    metadata: TaskMetadata = Field(default_factory=TaskMetadata)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    solution: SolutionSection = Field(default_factory=SolutionSection)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) else value


class Task(BaseModel):
    """One loaded task: its config, instruction and the paths of its parts."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str
    path: Path
    config: TaskToml
    instruction: str
    workdir: str = Field(description="the image's final WORKDIR; the default cwd of commands")
    dockerfile: DockerfileFacts | None = None

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def has_solution(self) -> bool:
        return (self.solution_dir / "solve.sh").is_file()

    @classmethod
    def load(cls, path: Path | str) -> Task:
        """Load the task in directory `path`; raises TaskFormatError with the exact problem."""
        path = Path(path).resolve()
        if not path.is_dir():
            raise TaskFormatError(f"{path}: not a task directory")
        config = _load_toml(path / "task.toml")
        instruction_path = path / "instruction.md"
        if not instruction_path.is_file():
            raise TaskFormatError(f"{instruction_path}: missing (the task's instruction)")
        instruction = instruction_path.read_text().strip()
        if not instruction:
            raise TaskFormatError(f"{instruction_path}: empty (expected the task's instruction)")
        test_sh = path / "tests" / "test.sh"
        if not test_sh.is_file():
            raise TaskFormatError(f"{test_sh}: missing (the verifier script)")
        dockerfile_path = path / "environment" / "Dockerfile"
        facts = None
        if dockerfile_path.is_file():
            try:
                facts = read_dockerfile(dockerfile_path)
            except DockerfileError as exc:
                raise TaskFormatError(str(exc)) from None
        elif not config.environment.docker_image:
            raise TaskFormatError(
                f"{dockerfile_path}: missing, and task.toml [environment] has no docker_image "
                "(expected one of them)"
            )
        name = str(config.task.get("name") or path.name)
        workdir = facts.workdir if facts and facts.workdir != "/" else "/app"
        return cls(
            name=name, path=path, config=config, instruction=instruction,
            workdir=workdir, dockerfile=facts,
        )


def _load_toml(path: Path) -> TaskToml:
    if not path.is_file():
        raise TaskFormatError(f"{path}: missing")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"{path}: not valid TOML: {exc}") from None
    try:
        return TaskToml.model_validate(raw)
    except ValidationError as exc:
        raise TaskFormatError(f"{path}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc and loc[0] in TaskToml.model_fields and loc[0] not in ("version", "task"):
            where = f"[{loc[0]}] {'.'.join(loc[1:])}".strip()
        else:
            where = ".".join(loc)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key (check its spelling against the terminal-bench-2 format)"
        elif err["type"] != "missing" and not isinstance(err.get("input"), dict | list):
            message += f" (got {err.get('input')!r})"
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


class TaskSet:
    """The tasks of one directory (each subdirectory holding a task.toml), by name."""

    def __init__(self, tasks: list[Task]) -> None:
        self._tasks: dict[str, Task] = {}
        for task in tasks:
            if task.name in self._tasks:
                raise TaskFormatError(
                    f"{task.path}: task name {task.name!r} already used by "
                    f"{self._tasks[task.name].path}"
                )
            self._tasks[task.name] = task

    @classmethod
    def load(cls, root: Path | str) -> TaskSet:
        """Load every task under `root`; the first malformed one raises TaskFormatError."""
        root = Path(root)
        if not root.is_dir():
            raise TaskFormatError(f"{root}: not a directory of tasks")
        dirs = sorted(p for p in root.iterdir() if (p / "task.toml").is_file())
        if not dirs:
            raise TaskFormatError(f"{root}: no task directories (subdirectories with task.toml)")
        return cls([Task.load(d) for d in dirs])

    def get(self, name: str) -> Task:
        try:
            return self._tasks[name]
        except KeyError:
            raise NotFound(f"unknown task {name!r}") from None

    @property
    def names(self) -> list[str]:
        return list(self._tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, name: object) -> bool:
        return name in self._tasks
