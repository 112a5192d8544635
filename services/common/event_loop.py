"""Running a service's main coroutine on the event loop its config names.

`asyncio` is the standard library's loop; `uvloop` (libuv, in C) costs less per socket event,
which is what a proxy's hot path is made of (the router's HTTP front and its calls to the
engines). Transports of uvloop are not subclasses of asyncio's, so protocols must not check
for them by type.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from services.common.errors import ConfigError

EventLoopName = Literal["asyncio", "uvloop"]
_T = TypeVar("_T")


def loop_factory(name: EventLoopName) -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of the named loop; a clear error when uvloop is not installed."""
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError("event_loop = \"uvloop\" needs the uvloop package (pip install "
                          "uvloop; Linux and macOS only), or set event_loop = \"asyncio\"") from exc
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, _T], name: EventLoopName) -> _T:
    """`asyncio.run(main)` on the named loop."""
    try:
        factory = loop_factory(name)
    except ConfigError:
        main.close()  # never awaited: say so quietly, not with a RuntimeWarning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def running_loop_name() -> str:
    """`uvloop` or `asyncio`: the loop this is called on (for admin state); "" off any loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return ""
    return type(loop).__module__.partition(".")[0]
