"""One supervised local stack (`riptide up`), one fault after another; after each the run goes
on by itself and the audit finds every produced group trained once, dropped with a reason, or
still in the stream: none lost, none trained twice.

The tests share the stack (starting it is most of the cost) and run in file order; each one
injects one fault, waits for the trainer to take more steps, and audits. The "what survives
what" table of docs/faults.md lists these faults.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.testing.fault_stack import FaultStack
from services.testing.proc_tree import is_running

pytestmark = pytest.mark.slow
STEP_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[FaultStack]:
    run_dir = Path(tempfile.mkdtemp(prefix="riptide-faults-"))
    fs = FaultStack(run_dir)
    fs.start()
    fs.wait_steps(1, STEP_TIMEOUT_S)
    yield fs
    fs.stop()
    if request.session.testsfailed:
        print(f"fault suite failed: the run directory {run_dir} is kept")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)


def _goes_on_and_loses_nothing(stack: FaultStack, what: str) -> None:
    stack.wait_steps(1, STEP_TIMEOUT_S)
    audit = stack.audit()
    print(what, audit.as_dict())
    assert audit.lost == [] and audit.duplicated == [] and audit.trained_and_dropped == []
    assert audit.trained > 0


def test_router_sigkill(stack: FaultStack) -> None:
    stack.kill("router")
    # The new router starts empty; the rollout registers its engine again (reconciling, or
    # after the next weight update if the kill broke one).
    stack.wait_for(lambda: (stack.state("router").get("num_routable") or 0) >= 1, 120,
                   "the engine routable in the new router")
    _goes_on_and_loses_nothing(stack, "router")


def test_sandbox_sigkill(stack: FaultStack) -> None:
    stack.kill("sandbox")
    _goes_on_and_loses_nothing(stack, "sandbox")


def test_engine_sigkill(stack: FaultStack) -> None:
    before = stack.pid("engine")
    stack.kill("engine")
    stack.wait_for(lambda: stack.pid("engine") not in (None, before), 60, "a new engine")
    _goes_on_and_loses_nothing(stack, "engine")


def test_engine_hang_is_killed_and_replaced(stack: FaultStack) -> None:
    # Each missed check costs the 1 s interval plus the 5 s load timeout: 3 take ~18 s, more
    # on a busy machine; the engine stays stopped until the fleet kills it.
    hung = stack.hang_engine(150.0)
    assert not is_running(hung), \
        f"the hung engine was not killed: {stack.state('rollout').get('engines')}"
    # Then a fresh engine's start: slow on a busy machine.
    stack.wait_for(lambda: stack.pid("engine") not in (None, hung), 150, "a new engine")
    _goes_on_and_loses_nothing(stack, "engine hang")


def test_failing_sandbox_creation_gives_recorded_drops(stack: FaultStack) -> None:
    assert stack.fail_sandboxes(4.0) >= 1, "no sandbox creation failed while injected"
    _goes_on_and_loses_nothing(stack, "sandbox creation failures")


def test_redis_sigkill_append_only(stack: FaultStack) -> None:
    before = stack.pid("redis")
    stack.kill("redis")  # SIGKILL; the supervisor starts it again on the same data
    stack.wait_for(lambda: stack.pid("redis") not in (None, before), 60, "a new redis")
    _goes_on_and_loses_nothing(stack, "redis SIGKILL")


def test_rollout_sigkill_new_incarnation_new_ids(stack: FaultStack) -> None:
    produced_before = stack.audit().produced
    stack.kill("rollout")
    _goes_on_and_loses_nothing(stack, "rollout")
    # The trainer may first train the backlog; the new incarnation's groups follow.
    stack.wait_for(lambda: stack.audit().produced > produced_before, STEP_TIMEOUT_S,
                   "groups written by the new rollout incarnation")


def test_trainer_killed_during_a_sync(stack: FaultStack) -> None:
    assert stack.kill_trainer_during_sync(), "no weight update seen to kill the trainer in"
    _goes_on_and_loses_nothing(stack, "trainer during sync")

    def settled_unpaused() -> bool:  # the restarted trainer's own next sync may be running
        updates = stack.state("rollout").get("weight_updates") or {}
        return not updates.get("in_progress") and updates.get("engines_paused") is False

    stack.wait_for(settled_unpaused, 120, "no engine left paused once no update runs")


def test_trainer_sigkill_resumes_from_its_checkpoint(stack: FaultStack) -> None:
    stack.kill("trainer")
    start = time.monotonic()
    _goes_on_and_loses_nothing(stack, "trainer")
    assert time.monotonic() - start < STEP_TIMEOUT_S
    assert "trainer died" in stack.log_text() and "trainer restarted" in stack.log_text()
