"""The metrics exporter: events in, scalars out to the configured sinks.

It reads nothing itself, so it couples no service: `riptide up` feeds it the events its
progress lines already tail from Redis (live), and `riptide events export --format
tensorboard|wandb` feeds it a saved events file or a finished run's stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from services.common.config import TrackingConfig
from services.common.events import Event
from services.common.tracking.scalars import ScalarBuilder
from services.common.tracking.sinks import ScalarSink, TensorBoardSink, WandbSink


class MetricsExporter:
    """Turns each event into scalars and writes them to every sink."""

    def __init__(self, sinks: list[ScalarSink]) -> None:
        self.sinks = sinks
        self.num_scalars = 0
        self._builder = ScalarBuilder()

    @classmethod
    def from_config(cls, config: TrackingConfig, run_name: str,
                    default_dir: Path) -> MetricsExporter:
        """The sinks `config` enables; W&B files go to `wandb_dir` or `default_dir`."""
        sinks: list[ScalarSink] = []
        if config.tensorboard_dir is not None:
            sinks.append(TensorBoardSink(config.tensorboard_dir))
        if config.wandb_project is not None:
            sinks.append(WandbSink(config.wandb_project, config.wandb_mode,
                                   config.wandb_dir or default_dir, run_name))
        return cls(sinks)

    def add(self, event: Event) -> None:
        if scalars := self._builder.add(event):
            self.num_scalars += len(scalars)
            for sink in self.sinks:
                sink.write(scalars)

    def add_all(self, events: Iterable[Event]) -> int:
        """Export every event, in order; returns the number of scalars written."""
        for event in events:
            self.add(event)
        return self.num_scalars

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
