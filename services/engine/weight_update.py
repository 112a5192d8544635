"""Weight updates over a collective, as SGLang does them.

`/init_weights_update_group` joins the trainer's group (this engine is rank `rank_offset`),
`/update_weights_from_distributed` receives every tensor by broadcast from rank 0 in the
order of `names` and only then loads them all by Hugging Face name, and
`/destroy_weights_update_group` leaves. Requests are validated before any byte is received.

A broadcast whose order does not match `names` sends tensors of other sizes than announced.
gloo checks a received size only against the buffer it lands in, and a larger message kills
the process (`gloo::EnforceNotMet` thrown on its transport thread). So over gloo each tensor is
received into a buffer wide enough for any announced tensor (twice over, for a wider dtype),
with a pattern every engine derives alike from the request (tree forwarding between engine
ranks then stays consistent) written around the expected end: a pattern overwritten past the
end means a larger tensor arrived, an intact pattern before it a smaller one. Either is a 400
once every broadcast of the request is consumed, and no weight is loaded (a tensor larger
than the buffer still ends the process, as gloo does). NCCL needs equal counts on every
rank, so there the buffers stay exact.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common import weight_group
from services.common.errors import Conflict, InvalidRequest
from services.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitGroupRequest(Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsRequest(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    # SGLang 0.5.23 fields: `torch_empty_cache` frees the CUDA cache after loading; `selector`
    # picks which weights an engine serving several takes (the built-in engine has one model).
    torch_empty_cache: bool = False
    selector: Any = None


class DestroyGroupRequest(Body):
    group_name: str = "weight_update_group"


def parse_body(model: type[Body], body: Any) -> Any:
    """Validate a JSON body, turning pydantic's complaint into one InvalidRequest."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidRequest(problems) from None


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"unknown dtype {name!r}")
    return dtype


class WeightUpdater:
    """The weight-update groups this engine has joined, and receiving tensors through them."""

    def __init__(self, runner: ModelRunner, timeout_s: float) -> None:
        self.runner = runner
        self.timeout_s = timeout_s
        self.groups: dict[str, Any] = {}
        self.backends: dict[str, str] = {}

    def init_group(self, req: InitGroupRequest) -> None:
        """Blocks until the trainer and every engine rank have joined."""
        if req.group_name in self.groups:
            raise Conflict(f"weight update group {req.group_name!r} already exists")
        if req.rank_offset >= req.world_size:
            raise InvalidRequest(
                f"rank_offset {req.rank_offset} must be below world_size {req.world_size}"
            )
        backend = req.backend
        if backend == "nccl" and self.runner.device.type == "cpu":
            raise InvalidRequest("backend nccl needs a CUDA engine; use gloo on CPU")
        self.backends[req.group_name] = backend
        self.groups[req.group_name] = weight_group.init_custom_process_group(
            backend=backend,
            init_method=f"tcp://{req.master_address}:{req.master_port}",
            world_size=req.world_size,
            rank=req.rank_offset,
            group_name=req.group_name,
            timeout_s=self.timeout_s,
        )
        log.info(
            "joined weight update group %s as rank %d/%d",
            req.group_name,
            req.rank_offset,
            req.world_size,
        )

    def destroy_group(self, req: DestroyGroupRequest) -> None:
        group = self.groups.pop(req.group_name, None)
        self.backends.pop(req.group_name, None)
        if group is None:
            raise InvalidRequest(f"no weight update group named {req.group_name!r}")
        weight_group.destroy_process_group(group)

    def destroy_all(self) -> None:
        for name in list(self.groups):
            self.destroy_group(DestroyGroupRequest(group_name=name))

    def validate(self, req: UpdateWeightsRequest) -> list[torch.dtype]:
        """Check the request against the model; raises InvalidRequest naming the problem."""
        if req.group_name not in self.groups:
            raise InvalidRequest(
                f"no weight update group named {req.group_name!r}; "
                "call /init_weights_update_group first"
            )
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise InvalidRequest(
                f"names, dtypes and shapes differ in length "
                f"({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})"
            )
        if len(set(req.names)) != len(req.names):
            raise InvalidRequest("names repeat a parameter")
        if req.load_format not in (None, "flattened_bucket"):
            raise InvalidRequest(f"unknown load_format {req.load_format!r}")
        dtypes = [torch_dtype(d) for d in req.dtypes]
        if req.load_format == "flattened_bucket" and len(set(dtypes)) > 1:
            raise InvalidRequest("a flattened bucket must hold tensors of one dtype")
        self.runner.check_weights(req.names, req.shapes)
        return dtypes

    def receive(self, req: UpdateWeightsRequest, dtypes: list[torch.dtype]) -> dict[str, Any]:
        """Receive every tensor by broadcast from rank 0, in the order of `names`.

        Raises InvalidRequest (after consuming the whole broadcast) when a tensor arrived with
        another size than announced.
        """
        group = self.groups[req.group_name]
        device = self.runner.device
        checked = self.backends.get(req.group_name) == "gloo"
        if req.load_format == "flattened_bucket":
            sizes = [int(torch.Size(s).numel()) for s in req.shapes]
            specs = [(dtypes[0], [sum(sizes)])]
        else:
            specs = list(zip(dtypes, req.shapes, strict=True))
        nbytes = [int(torch.Size(shape).numel()) * dtype.itemsize for dtype, shape in specs]
        # Room for any announced tensor, even sent in a dtype twice as wide.
        receiver = _CheckedReceiver(group, device, 2 * max(nbytes), _pattern(req)) \
            if checked else None
        received, wrong = [], []
        for index, (dtype, shape) in enumerate(specs):
            if receiver is None:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                weight_group.broadcast_tensor(tensor, group)
            else:
                tensor, problem = receiver.receive(dtype, shape, nbytes[index])
                if problem:
                    wrong.append(f"#{index} ({req.names[index] if len(specs) > 1 else 'bucket'}, "
                                 f"{nbytes[index]} bytes announced) arrived {problem}")
            received.append(tensor)
        if wrong:
            raise InvalidRequest(
                "the broadcast does not match names/dtypes/shapes: tensor "
                + "; ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
                + ". Broadcast each tensor in the order of `names`; no weight was loaded."
            )
        if req.load_format == "flattened_bucket":
            parts = received[0].split(sizes)
            return {n: p.view(s) for n, p, s in zip(req.names, parts, req.shapes, strict=True)}
        return dict(zip(req.names, received, strict=True))


def _pattern(req: UpdateWeightsRequest) -> bytes:
    """A fill pattern every engine rank derives alike from the request."""
    return hashlib.sha256(f"{req.group_name}|{'|'.join(req.names)}".encode()).digest()


class _CheckedReceiver:
    """Receives gloo broadcasts into one wide byte buffer with a pattern around each expected
    end (see the module docstring). Only that window is written before each receive."""

    _PROBE = 16  # bytes compared on each side of the expected end

    def __init__(self, group: Any, device: torch.device, capacity: int, pattern: bytes) -> None:
        self.group = group
        self.pattern = torch.frombuffer(bytearray((pattern * 2)[: 2 * self._PROBE]),
                                        dtype=torch.uint8).to(device)
        self.buffer = torch.empty(capacity + self._PROBE, dtype=torch.uint8, device=device)

    def receive(self, dtype: torch.dtype, shape: list[int],
                nbytes: int) -> tuple[torch.Tensor, str]:
        probe = self._PROBE
        start = max(0, nbytes - probe)
        window = slice(start, nbytes + probe)
        self.buffer[window] = self.pattern[probe - (nbytes - start):]
        expected = self.buffer[window].clone()
        weight_group.broadcast_tensor(self.buffer, self.group)
        got = self.buffer[window]
        split = nbytes - start  # bytes of the window before the expected end
        problem = ""
        if not torch.equal(got[split:], expected[split:]):
            problem = "larger"
        elif split and torch.equal(got[:split], expected[:split]):
            problem = "smaller"
        data = self.buffer[:nbytes].clone().view(dtype).view(shape)
        return data, problem
