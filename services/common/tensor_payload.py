"""SGLang's `/update_weights_from_tensor` payload: one base64 string per TP rank, each a
`multiprocessing` (ForkingPickler) pickle of the named tensors.

A CUDA tensor pickles as a CUDA IPC handle of its allocation (the receiver maps the sender's
memory, nothing is copied); a CPU tensor as a shared-memory file (torch's `file_system`
sharing strategy: the `file_descriptor` one passes descriptors through a socket only a child
process can reach). Two shapes, as SGLang's `load_format` says:

- None or "direct": a list of `(name, tensor)` pairs;
- "flattened_bucket": `{"flattened_tensor": t, "metadata": [FlattenedTensorMetadata...]}`, the
  tensors as slices of one flat tensor (SGLang's `FlattenedTensorBucket`).

`encode` writes the first shape; when the tensors are views of one buffer, a bucket costs
one IPC handle. `decode` unpickles with an allow-list (a pickle can run any callable, so only
torch's tensor rebuilders and the bucket metadata class are accepted), and maps a device
given as a GPU UUID (SGLang's patched reductions, robust to differing CUDA_VISIBLE_DEVICES)
to the local index. Sender and receiver both import this module; it imports only torch.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

from services.common.errors import InvalidRequest

LOAD_FORMATS = (None, "direct", "flattened_bucket")


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket, as SGLang's `weight_sync.tensor_bucket` names it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    if isinstance(args[6], str):  # a GPU UUID (SGLang's monkey_patch_torch_reductions)
        args = (*args[:6], _device_index(args[6]), *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise InvalidRequest(f"the payload's GPU {uuid} is not visible to this engine")


def _refuse_fd(*_: Any) -> Any:
    raise InvalidRequest(
        "a CPU tensor shared by file descriptor cannot reach another process: the sender must "
        "use torch.multiprocessing.set_sharing_strategy('file_system')")


class _RefusedFd:
    """Stands for multiprocessing's DupFd, which a pickle builds as an object."""

    def __new__(cls, *args: Any) -> Any:
        return _refuse_fd()


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
        reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _refuse_fd,
    ("multiprocessing.resource_sharer", "DupFd"): _RefusedFd,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    (__name__, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise InvalidRequest(f"the payload refers to {module}.{name}, which a tensor payload "
                             "never needs: refused")


def decode(payload: str, load_format: str | None) -> dict[str, torch.Tensor]:
    """The named tensors of one rank's payload; raises InvalidRequest saying what is wrong."""
    if load_format not in LOAD_FORMATS:
        raise InvalidRequest(f"load_format {load_format!r} is not supported "
                             f"(supported: None, 'direct', 'flattened_bucket')")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"serialized_named_tensors[0] is not base64: {exc}") from None
    try:
        obj = _Unpickler(io.BytesIO(raw)).load()
    except InvalidRequest:
        raise
    except Exception as exc:  # a truncated or foreign pickle is the client's mistake
        raise InvalidRequest("serialized_named_tensors[0] is not a multiprocessing pickle of "
                             f"named tensors: {type(exc).__name__}: {exc}") from None
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    return _named(obj)


def _named(obj: Any) -> dict[str, torch.Tensor]:
    if not isinstance(obj, list | tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], torch.Tensor) for p in obj):
        raise InvalidRequest("the payload must be a list of (name, tensor) pairs "
                             f"(load_format None or 'direct'), got {type(obj).__name__}")
    named = dict(obj)
    if len(named) != len(obj):
        raise InvalidRequest("the payload repeats a parameter name")
    return named


def _unflatten(obj: Any) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise InvalidRequest("a flattened_bucket payload is a dict with keys flattened_tensor "
                             "and metadata")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise InvalidRequest("flattened_tensor must be a 1-D tensor")
    named: dict[str, torch.Tensor] = {}
    for meta in metadata:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise InvalidRequest("metadata must hold FlattenedTensorMetadata entries")
        shape = torch.Size(meta.shape)
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel() or \
                meta.end_idx - meta.start_idx != shape.numel():
            raise InvalidRequest(
                f"{meta.name}: elements [{meta.start_idx}, {meta.end_idx}) do not hold shape "
                f"{list(shape)} inside a flattened tensor of {flat.numel()}")
        named[meta.name] = flat[meta.start_idx:meta.end_idx].view(shape).to(meta.dtype)
    return named


# ---- the sender's side ---------------------------------------------------------------------

def encode(views: list[tuple[str, torch.Tensor]]) -> str:
    """Base64 of the ForkingPickler pickle of (name, tensor) pairs (SGLang's load_format None).

    CPU tensors go by the file_system strategy, which this sets for the whole process."""
    if any(t.device.type == "cpu" for _, t in views):
        torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(name, tensor) for name, tensor in views])
    return base64.b64encode(buf.getvalue()).decode("ascii")
