"""Where the scalars go: TensorBoard event files or a Weights & Biases run.

Both packages are the optional `tracking` extra, imported only when a sink is opened, so a
run without tracking never loads them; a missing extra is a ConfigError that says what to
install. TensorBoard has one x-axis per tag (the step: the trainer step for `train/*`,
`rollout/*` and `dropped/*`, the weight version for `eval/*`); W&B gets both axes as metrics
(`define_metric(..., step_metric=...)`), so its charts plot each tag against its own.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol

from services.common.errors import ConfigError, Unavailable
from services.common.tracking.scalars import Scalar

EXTRA_HINT = "pip install 'riptide[tracking]'"


def import_extra(module: str, what: str) -> ModuleType:
    """`module` of the tracking extra, or a ConfigError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        raise ConfigError(f"{what} needs the `tracking` extra ({missing} is not installed): "
                          f"{EXTRA_HINT}") from None


class ScalarSink(Protocol):
    """A destination of scalars."""

    def write(self, scalars: list[Scalar]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars as TensorBoard event files in `logdir` (read by `tensorboard --logdir`)."""

    def __init__(self, logdir: str | Path) -> None:
        writer = import_extra("tensorboard.summary.writer.event_file_writer",
                              "TensorBoard export")
        self._pb = import_extra("tensorboard.compat.proto.event_pb2", "TensorBoard export")
        self._summary = import_extra("tensorboard.compat.proto.summary_pb2",
                                     "TensorBoard export")
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.logdir = str(logdir)
        self._writer = writer.EventFileWriter(self.logdir, flush_secs=5)

    def write(self, scalars: list[Scalar]) -> None:
        for s in scalars:
            value = self._summary.Summary.Value(tag=s.tag, simple_value=s.value)
            self._writer.add_event(self._pb.Event(wall_time=s.wall_time, step=s.step,
                                                  summary=self._summary.Summary(value=[value])))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars as one W&B run; offline mode writes its files under `directory` only."""

    def __init__(self, project: str, mode: Literal["offline", "online"], directory: str | Path,
                 run_name: str, config: dict[str, Any] | None = None) -> None:
        wandb = import_extra("wandb", "Weights & Biases export")
        Path(directory).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(project=project, mode=mode, dir=str(directory),
                                   name=run_name, config=config or {}, reinit="create_new")
        except Exception as exc:  # noqa: BLE001 - wandb raises its own types (login, network)
            raise Unavailable(f"cannot start a Weights & Biases run in project {project!r} "
                              f"({mode}): {exc}") from None
        for axis in ("trainer_step", "weight_version"):
            self._run.define_metric(axis)
        for prefix in ("train", "rollout", "dropped"):
            self._run.define_metric(f"{prefix}/*", step_metric="trainer_step")
        self._run.define_metric("eval/*", step_metric="weight_version")

    @property
    def run_dir(self) -> str:
        """The run's folder (`wandb sync` takes it); wandb's `run.dir` is its files/ inside."""
        return str(Path(self._run.dir).parent)

    def write(self, scalars: list[Scalar]) -> None:
        rows: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
        for s in scalars:
            rows[(s.axis, s.step)][s.tag] = s.value
        for (axis, step), values in rows.items():
            self._run.log({axis: step, **values})

    def close(self) -> None:
        self._run.finish()
