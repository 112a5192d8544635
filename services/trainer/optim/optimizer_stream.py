"""Adam(W) with fp32 master weights and moments kept per bucket, in memory or on local disk.

`MasterAdam` owns the optimizer state of a model whose parameters may be bf16 or fp32: an
fp32 master copy and both Adam moments, laid out as buckets (a contiguous range of the
flattened parameters, split across parameter boundaries). Each `step()` updates one bucket
at a time and copies the new master values back into the model parameters.

With a `DiskBucketStore` (`--stream-optimizer-state-to-disk DIR`) each bucket is one file
`[master | exp_avg | exp_avg_sq]`, memory-mapped only while it is updated: a background
thread maps bucket i+1 and faults it in while bucket i is updated, and bucket i-1, already
dropped, is written back by the kernel from the page cache. At most two buckets (briefly a
third) are mapped, so peak optimizer-state memory is about two buckets (plus one fp32 grad
bucket) whatever the model size. With a `MemoryBucketStore` the same code keeps every bucket
in RAM: the in-memory optimizer the disk one is compared against.

By default the state lives on the parameters' device (the GPU), and there each bucket is
updated with one kernel per Adam operation (`fused`); disk-streamed buckets pass through that
device. The arithmetic is torch.optim.Adam/AdamW's single-tensor path operation for operation, so
with fp32 moments the result equals torch's, and megatron-core's DistributedOptimizer's
(which wraps torch's AdamW on CPU), bit for bit; the tests check both. With a `StateShard`
(optimizer_shard.py) a data-parallel replica keeps and updates only the buckets it owns and
receives the other buckets' new parameter values from their owners.
Called by the trainer's policy (services/trainer/model/policy.py) and checkpoint.py.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from services.trainer.optim.optimizer_shard import StateShard

STATE_FILE = "optimizer.json"


@dataclass
class Slice:
    """A contiguous piece of one parameter, placed at `offset` inside its bucket."""

    param_index: int
    start: int
    numel: int
    offset: int
    step: int = 0


@dataclass
class Bucket:
    index: int
    numel: int
    slices: list[Slice]


def plan_buckets(params: list[Tensor], bucket_numel: int) -> list[Bucket]:
    """Split the flattened parameters into buckets of at most `bucket_numel` elements."""
    buckets: list[Bucket] = []
    current: list[Slice] = []
    filled = 0
    for index, param in enumerate(params):
        start = 0
        while start < param.numel():
            take = min(param.numel() - start, bucket_numel - filled)
            current.append(Slice(index, start, take, filled))
            start += take
            filled += take
            if filled == bucket_numel:
                buckets.append(Bucket(len(buckets), filled, current))
                current, filled = [], 0
    if current:
        buckets.append(Bucket(len(buckets), filled, current))
    return buckets


class BucketStore:
    """Where bucket state lives; `buffers()` yields each bucket's bytes, written back after."""

    def __init__(self, bucket_nbytes: list[int]) -> None:
        self.bucket_nbytes = bucket_nbytes

    def buffers(self) -> Iterator[Tensor]:
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        """Copy every bucket into `directory` (bucket_00000.bin, ...)."""
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        """Replace every bucket with the files `save` wrote."""
        raise NotImplementedError

    def close(self) -> None:
        """Release threads and files."""


def _bucket_file(directory: Path, index: int) -> Path:
    return directory / f"bucket_{index:05d}.bin"


def _read_into(path: Path, buf: Tensor) -> None:
    view = buf.numpy().data.cast("B")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path}: short read ({done} of {len(view)} bytes)")
            done += n


def _write_from(path: Path, buf: Tensor) -> None:
    view = buf.numpy().data.cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
    finally:
        os.close(fd)


class MemoryBucketStore(BucketStore):
    """Every bucket in memory on `device` (host RAM, or the GPU): the in-memory optimizer."""

    def __init__(self, bucket_nbytes: list[int], device: torch.device | None = None) -> None:
        super().__init__(bucket_nbytes)
        self._buckets = [torch.zeros(n, dtype=torch.uint8, device=device) for n in bucket_nbytes]

    def buffers(self) -> Iterator[Tensor]:
        yield from self._buckets

    def save(self, directory: Path) -> None:
        for index, buf in enumerate(self._buckets):
            _write_from(_bucket_file(directory, index), buf.cpu())

    def load(self, directory: Path) -> None:
        for index, buf in enumerate(self._buckets):
            host = torch.empty_like(buf, device="cpu")
            _read_into(_bucket_file(directory, index), host)
            buf.copy_(host)


class DiskBucketStore(BucketStore):
    """One file per bucket under `directory`, memory-mapped one bucket at a time.

    A bucket is mapped (MAP_SHARED) only while it is updated: the I/O thread maps bucket
    i+1 and faults its pages in while bucket i is computed, and a bucket is unmapped as soon
    as the updater drops it, its dirty pages left to the kernel's write-back. No copy is
    made between the file and the optimizer's arithmetic.
    """

    def __init__(self, bucket_nbytes: list[int], directory: Path) -> None:
        super().__init__(bucket_nbytes)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optstate-io")
        zeros = torch.zeros(max(bucket_nbytes, default=0), dtype=torch.uint8)
        for index, n in enumerate(bucket_nbytes):
            _write_from(self._path(index), zeros[:n])

    def _path(self, index: int) -> Path:
        return _bucket_file(self.directory, index)

    def _map(self, index: int) -> Tensor:
        n = self.bucket_nbytes[index]
        mapped = torch.from_file(str(self._path(index)), shared=True, size=n, dtype=torch.uint8)
        if n >= 8:  # touch one word per page so that the updater never waits on a fault
            mapped[: n - n % 8].view(torch.int64)[::512].sum()
        return mapped

    def buffers(self) -> Iterator[Tensor]:
        count = len(self.bucket_nbytes)
        if count == 0:
            return
        pending: Future[Tensor] = self._io.submit(self._map, 0)
        for index in range(count):
            current = pending.result()
            if index + 1 < count:
                pending = self._io.submit(self._map, index + 1)
            yield current
            del current

    def save(self, directory: Path) -> None:
        for index in range(len(self.bucket_nbytes)):
            shutil.copyfile(self._path(index), _bucket_file(directory, index))

    def load(self, directory: Path) -> None:
        for index in range(len(self.bucket_nbytes)):
            shutil.copyfile(_bucket_file(directory, index), self._path(index))

    def close(self) -> None:
        self._io.shutdown(wait=True)


def megatron_no_decay(named_params: list[tuple[str, Tensor]]) -> list[bool]:
    """megatron-core's default: no weight decay on biases and 1-D parameters (norms)."""
    return [name.endswith(".bias") or p.dim() == 1 for name, p in named_params]


class MasterAdam:
    """Adam/AdamW over fp32 master weights held in a BucketStore (memory or disk).

    `no_decay[i]` exempts parameter i from weight decay (see `megatron_no_decay`). With a
    `shard`, only the buckets this replica owns have state here (see optimizer_shard.py).
    The state lives and is updated on `device` (None: the parameters' device, i.e. the GPU
    of a GPU trainer; the CPU keeps it in host RAM); disk-streamed buckets are copied to that
    device for their update and back. `fused` updates a whole bucket with one kernel per Adam
    operation when every slice in it has a gradient and the same step count (None: on CUDA);
    the per-slice path is torch's single-tensor Adam element for element.

    fp32 parameters updated per slice where the state lives are their own master weights
    (`master_in_params`): the buckets hold only the moments, and the update writes into the
    parameters, the same arithmetic on the same values as with a separate fp32 copy, one
    parameter-sized copy less (for a 135M model in fp32: 0.5 GB of RAM and of each
    checkpoint). `load` then restores only the moments: the parameters come from the model's
    own state (the policy's checkpoint holds both).
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        state_dir: str | Path | None = None,
        bucket_mb: float = 64.0,
        moments_dtype: torch.dtype = torch.float32,
        no_decay: list[bool] | None = None,
        shard: StateShard | None = None,
        device: torch.device | None = None,
        fused: bool | None = None,
    ) -> None:
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"moments_dtype must be float32 or bfloat16, not {moments_dtype}")
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.decoupled = weight_decay, decoupled_weight_decay
        self.moments_dtype = moments_dtype
        self.no_decay = no_decay or [False] * len(self.params)
        self._moment_size = torch.finfo(moments_dtype).bits // 8
        bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        if shard is not None:  # at least one bucket per replica, so every one holds a share
            total = sum(p.numel() for p in self.params)
            bucket_numel = max(1, min(bucket_numel, -(-total // shard.size)))
        self.buckets = plan_buckets(self.params, bucket_numel)
        self.shard = shard
        self.owned = [b for b in self.buckets if shard is None or shard.owns(b.index)]
        default = self.params[0].device if self.params else torch.device("cpu")
        self.device = torch.device(device) if device is not None else default
        self.fused = self.device.type == "cuda" if fused is None else fused
        self.master_in_params = not self.fused and all(
            p.dtype == torch.float32 and p.device == self.device for p in self.params)
        self._master_size = 0 if self.master_in_params else 4
        nbytes = [b.numel * (self._master_size + 2 * self._moment_size) for b in self.owned]
        if state_dir is None:
            self.store: BucketStore = MemoryBucketStore(nbytes, self.device)
        else:
            self.store = DiskBucketStore(nbytes, Path(state_dir))
        largest = max((b.numel for b in self.owned), default=0)
        self._grad = torch.empty(largest, device=self.device)
        self._staging: Tensor | None = None  # a disk bucket's copy on a non-CPU device
        self._init_master()

    def _views(self, bucket: Bucket, buf: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """The bucket's master weights (None: they are the parameters) and moments."""
        n, ms, w = bucket.numel, self._moment_size, self._master_size
        master = None if self.master_in_params else buf[: w * n].view(torch.float32)
        exp_avg = buf[w * n : (w + ms) * n].view(self.moments_dtype)
        exp_avg_sq = buf[(w + ms) * n : (w + 2 * ms) * n].view(self.moments_dtype)
        return master, exp_avg, exp_avg_sq

    def _param_slice(self, s: Slice) -> Tensor:
        return self.params[s.param_index].detach().view(-1)[s.start : s.start + s.numel]

    def _init_master(self) -> None:
        for bucket, buf in zip(self.owned, self.store.buffers(), strict=True):
            buf.zero_()
            master, _, _ = self._views(bucket, buf)
            if master is None:
                continue
            for s in bucket.slices:
                master[s.offset : s.offset + s.numel].copy_(self._param_slice(s))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step over every parameter that has a gradient, bucket by bucket."""
        for bucket, buf in zip(self.owned, self.store.buffers(), strict=True):
            if buf.device == self.device:
                self._update_bucket(bucket, buf)
                continue
            # A bucket from disk: through the device and back (the I/O thread meanwhile
            # maps and faults in the next one).
            if self._staging is None:
                largest = max(self.store.bucket_nbytes)
                self._staging = torch.empty(largest, dtype=torch.uint8, device=self.device)
            staged = self._staging[: buf.numel()]
            staged.copy_(buf)
            self._update_bucket(bucket, staged)
            buf.copy_(staged)
        if self.shard is not None:
            self.shard.share(self.buckets, self._param_slice)

    def _update_bucket(self, bucket: Bucket, buf: Tensor) -> None:
        grads = [self.params[s.param_index].grad for s in bucket.slices]
        steps = {s.step for s in bucket.slices}
        if self.fused and len(steps) == 1 and all(g is not None for g in grads):
            self._update_whole_bucket(bucket, buf)
            return
        master, m_store, v_store = self._views(bucket, buf)
        grad_buf = self._grad[: bucket.numel]
        lowp = self.moments_dtype != torch.float32
        beta1, beta2 = self.betas
        for s in bucket.slices:
            grad_param = self.params[s.param_index].grad
            if grad_param is None:
                continue
            sl = slice(s.offset, s.offset + s.numel)
            param = self._param_slice(s) if master is None else master[sl]
            grad = grad_buf[sl]
            grad.copy_(grad_param.view(-1)[s.start : s.start + s.numel])
            exp_avg = m_store[sl].float() if lowp else m_store[sl]
            exp_avg_sq = v_store[sl].float() if lowp else v_store[sl]
            s.step += 1
            if self.weight_decay != 0 and not self.no_decay[s.param_index]:
                if self.decoupled:
                    param.mul_(1 - self.lr * self.weight_decay)
                else:
                    grad.add_(param, alpha=self.weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** float(s.step)
            bias_correction2 = 1 - beta2 ** float(s.step)
            step_size = self.lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(self.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)
            if lowp:
                m_store[sl].copy_(exp_avg)
                v_store[sl].copy_(exp_avg_sq)
            if master is not None:
                self._param_slice(s).copy_(param)

    def _update_whole_bucket(self, bucket: Bucket, buf: Tensor) -> None:
        """`_update_bucket`'s arithmetic over the whole bucket at once (one kernel per Adam
        operation instead of one per slice); the same values element for element."""
        master, m_store, v_store = self._views(bucket, buf)
        assert master is not None  # fused never keeps the master in the parameters
        grad = self._grad[: bucket.numel]
        lowp = self.moments_dtype != torch.float32
        beta1, beta2 = self.betas
        for s in bucket.slices:
            sl = slice(s.offset, s.offset + s.numel)
            grad_param = self.params[s.param_index].grad
            assert grad_param is not None  # checked by _update_bucket
            grad[sl].copy_(grad_param.view(-1)[s.start : s.start + s.numel])
            s.step += 1
            if self.weight_decay != 0 and not self.no_decay[s.param_index]:
                if self.decoupled:
                    master[sl].mul_(1 - self.lr * self.weight_decay)
                else:
                    grad[sl].add_(master[sl], alpha=self.weight_decay)
        step = float(bucket.slices[0].step)
        exp_avg = m_store.float() if lowp else m_store
        exp_avg_sq = v_store.float() if lowp else v_store
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(self.eps)
        master.addcdiv_(exp_avg, denom, value=-step_size)
        if lowp:
            m_store.copy_(exp_avg)
            v_store.copy_(exp_avg_sq)
        for s in bucket.slices:
            self._param_slice(s).copy_(master[s.offset : s.offset + s.numel])

    def state_nbytes(self) -> int:
        """Bytes of optimizer state (master, unless it is the parameters, and moments)
        this rank holds."""
        return sum(self.store.bucket_nbytes)

    def save(self, directory: Path) -> None:
        """Write the state (bucket files and step counts) into an existing directory."""
        steps = [[s.step for s in b.slices] for b in self.owned]
        meta = {
            "lr": self.lr,
            "moments_dtype": str(self.moments_dtype),
            "master_in_params": self.master_in_params,
            "bucket_numel": [b.numel for b in self.buckets],
            "shard": self._shard_key(),
            "steps": steps,
        }
        (directory / STATE_FILE).write_text(json.dumps(meta))
        self.store.save(directory)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote; the bucket layout must match this optimizer's. State
        saved with a separate master copy also loads into fp32 parameters that are their own
        master (an fp32 run's checkpoint from before they were): the copy goes into them."""
        meta = json.loads((directory / STATE_FILE).read_text())
        layout = [b.numel for b in self.buckets]
        saved_master = not meta.get("master_in_params", False)
        if (
            meta["bucket_numel"] != layout
            or meta["moments_dtype"] != str(self.moments_dtype)
            or (not saved_master and not self.master_in_params)
            or meta.get("shard", [0, 1]) != self._shard_key()
        ):
            raise ValueError(
                f"{directory}: optimizer state layout differs from this optimizer's "
                "(same model, parameter dtype, bucket_mb, moments dtype and data-parallel "
                "size are needed to resume)"
            )
        for bucket, steps in zip(self.owned, meta["steps"], strict=True):
            for s, step in zip(bucket.slices, steps, strict=True):
                s.step = step
        if saved_master and self.master_in_params:
            self._load_dropping_master(directory)
        else:
            self.store.load(directory)
        with torch.no_grad():
            for bucket, buf in zip(self.owned, self.store.buffers(), strict=True):
                master, _, _ = self._views(bucket, buf)
                if master is None:
                    continue  # the parameters are the master: the model's state holds them
                for s in bucket.slices:
                    self._param_slice(s).copy_(master[s.offset : s.offset + s.numel])
            if self.shard is not None:
                self.shard.share(self.buckets, self._param_slice)

    @torch.no_grad()
    def _load_dropping_master(self, directory: Path) -> None:
        """Bucket files of [master | moments]: the master into the parameters, the moments
        into this optimizer's buckets."""
        buffers = zip(self.owned, self.store.buffers(), strict=True)
        for position, (bucket, buf) in enumerate(buffers):  # files are numbered as `save` did
            saved = torch.empty(4 * bucket.numel + buf.numel(), dtype=torch.uint8)
            _read_into(_bucket_file(directory, position), saved)
            master = saved[: 4 * bucket.numel].view(torch.float32)
            for s in bucket.slices:
                self._param_slice(s).copy_(master[s.offset : s.offset + s.numel])
            buf.copy_(saved[4 * bucket.numel :])

    def _shard_key(self) -> list[int]:
        return [0, 1] if self.shard is None else [self.shard.rank, self.shard.size]

    def close(self) -> None:
        self.store.close()
