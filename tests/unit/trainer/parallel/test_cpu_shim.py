"""The CPU shim lets megatron-core's CUDA calls run on the CPU, in every thread that asks."""

from __future__ import annotations

import threading

import pytest
import torch

from services.trainer.parallel.cpu_shim import apply_cpu_shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is CPU-only")


def test_cuda_requests_land_on_cpu_and_rng_tracker_works() -> None:
    from megatron.core.tensor_parallel import random as mpu_random

    assert apply_cpu_shim() and apply_cpu_shim()  # idempotent
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"  # what megatron's optimizers check
    # megatron's rope slicing for context parallelism asks for pinned memory
    assert torch.tensor([0, 3], pin_memory=True).cuda().tolist() == [0, 3]
    tracker = mpu_random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    with tracker.fork():
        first = torch.rand(3)
    tracker2 = mpu_random.CudaRNGStatesTracker()
    tracker2.add("model-parallel-rng", 123)
    with tracker2.fork():
        assert torch.equal(torch.rand(3), first)


def test_each_thread_gets_the_mode() -> None:
    apply_cpu_shim()
    devices: list[str] = []

    def work() -> None:
        apply_cpu_shim()
        devices.append(torch.empty(1, device="cuda").device.type)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert devices == ["cpu"]
