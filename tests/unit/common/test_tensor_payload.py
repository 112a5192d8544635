"""SGLang's tensor payload: what the sender writes decodes to the same tensors (shared, not
copied), both of SGLang's shapes decode, and anything else is refused precisely."""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
import torch.multiprocessing as torch_mp

from services.common.errors import InvalidRequest
from services.common.tensor_payload import FlattenedTensorMetadata, decode, encode


def forking(obj: Any) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_encode_round_trips_views_of_one_shared_buffer() -> None:
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5.0))]
    torch_mp.set_sharing_strategy("file_system")
    buffer = torch.empty(17, dtype=torch.bfloat16).share_memory_()
    views = [("a.weight", buffer[:12].view(3, 4)), ("b.bias", buffer[12:])]
    for (_, view), (_, tensor) in zip(views, named, strict=True):
        view.copy_(tensor)
    got = decode(encode(views), None)
    assert list(got) == ["a.weight", "b.bias"]
    for name, tensor in named:
        assert torch.equal(got[name], tensor.to(torch.bfloat16))
    buffer.fill_(7)  # the decoded tensors map the sender's memory: no copy
    assert bool((got["a.weight"] == 7).all())


def test_flattened_bucket_of_sglang_names() -> None:
    torch_mp.set_sharing_strategy("file_system")
    flat = torch.arange(10.0)
    metadata = [FlattenedTensorMetadata("x", torch.Size([2, 3]), torch.float32, 0, 6, 6),
                FlattenedTensorMetadata("y", torch.Size([4]), torch.bfloat16, 6, 10, 4)]
    payload = forking({"flattened_tensor": flat, "metadata": metadata})
    for body in (payload, as_sglang_pickles(flat, metadata)):
        got = decode(body, "flattened_bucket")
        assert torch.equal(got["x"], flat[:6].view(2, 3))
        assert got["y"].dtype == torch.bfloat16 and got["y"].tolist() == [6.0, 7.0, 8.0, 9.0]


def as_sglang_pickles(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> str:
    """The payload as SGLang's senders pickle it: their metadata class lives in
    sglang.srt.weight_sync.tensor_bucket (a module the engine never imports)."""
    name = "sglang.srt.weight_sync.tensor_bucket"
    module = types.ModuleType(name)
    sglang_class = dataclasses.make_dataclass(
        "FlattenedTensorMetadata", [f.name for f in dataclasses.fields(FlattenedTensorMetadata)])
    sglang_class.__module__ = name
    module.FlattenedTensorMetadata = sglang_class  # type: ignore[attr-defined]
    parents = ["sglang", "sglang.srt", "sglang.srt.weight_sync"]
    sys.modules.update({p: types.ModuleType(p) for p in parents} | {name: module})
    try:
        theirs = [sglang_class(**dataclasses.asdict(m)) for m in metadata]
        payload = forking({"flattened_tensor": flat, "metadata": theirs})
    finally:
        for key in [*parents, name]:
            del sys.modules[key]
    assert name.encode() in base64.b64decode(payload)
    return payload


@pytest.mark.parametrize(("payload", "load_format", "words"), [
    ("%%", None, "not base64"),
    (base64.b64encode(pickle.dumps(print)).decode(), None, "builtins.print"),
    (base64.b64encode(b"\x80\x04junk").decode(), None, "not a multiprocessing pickle"),
    (base64.b64encode(pickle.dumps({"a": 1})).decode(), None, "list of (name, tensor)"),
    (base64.b64encode(pickle.dumps([("a", 1)])).decode(), None, "list of (name, tensor)"),
    (base64.b64encode(pickle.dumps([])).decode(), "flattened_bucket", "dict with keys"),
    (base64.b64encode(pickle.dumps([])).decode(), "auto", "load_format 'auto'"),
])
def test_refusals(payload: str, load_format: str | None, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(").replace(")", r"\)")):
        decode(payload, load_format)


def test_repeated_names_wrong_slices_and_descriptor_sharing_are_refused() -> None:
    torch_mp.set_sharing_strategy("file_system")
    t = torch.ones(2)
    with pytest.raises(InvalidRequest, match="repeats"):
        decode(forking([("a", t), ("a", t)]), None)
    bad = [FlattenedTensorMetadata("x", torch.Size([3]), torch.float32, 0, 2, 2)]
    with pytest.raises(InvalidRequest, match="do not hold shape"):
        decode(forking({"flattened_tensor": t, "metadata": bad}), "flattened_bucket")
    torch_mp.set_sharing_strategy("file_descriptor")
    try:
        payload = forking([("a", torch.ones(2))])
    finally:
        torch_mp.set_sharing_strategy("file_system")
    with pytest.raises(InvalidRequest, match="file_system"):
        decode(payload, None)
