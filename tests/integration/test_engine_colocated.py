"""The built-in engine's colocated contract on CPU, with a real engine process: SGLang's
`/update_weights_from_tensor` payload (shared-memory tensors, load_format None and
flattened_bucket) and its precise refusals, and `/release_memory_occupation` /
`/resume_memory_occupation` (a request waits while memory is released; updating released
weights is refused)."""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.tensor_payload import FlattenedTensorMetadata, encode
from services.common.tiny_model import create_tiny_model
from services.testing.engine_process import EngineProcess, tiny_model_path
from services.trainer.weights.weight_ipc import ColocatedWeightSender

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 3, 99, 42, 7, 61]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(tiny_model_path(tmp_path_factory.mktemp("tiny"))) as proc:
        yield proc


@pytest.fixture(scope="module")
def new_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = create_tiny_model(tmp_path_factory.mktemp("new"), seed=1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(model: Any) -> list[int]:
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=GREEDY["max_new_tokens"], eos_token_id=[], pad_token_id=0)
    return list(out[0, len(PROMPT):].tolist())


def message(reply: Any) -> str:
    body = reply.json()
    return str(body.get("message") or body.get("error", {}).get("message"))


def test_release_queues_and_resume_with_new_weights(engine: EngineProcess,
                                                    new_model: Any) -> None:
    want = greedy(new_model)
    sender = ColocatedWeightSender([engine.url], torch.float32, timeout_s=60)
    assert engine.generate(PROMPT, sampling_params=GREEDY)["output_ids"] != want
    usage = engine.get("/get_server_info").json()["memory_usage"]
    assert usage["weights_bytes"] == sum(t.numel() * 4 for t in new_model.parameters())
    released = sender.release(["kv_cache", "weights"])[0]
    assert released["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert released["freed_bytes"] > 0
    out: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: out.update(
        engine.generate(PROMPT, sampling_params=GREEDY)))
    waiting.start()
    time.sleep(1.0)
    assert not out  # queued while released
    assert engine.get("/get_server_info").json()["memory_usage"]["weights_bytes"] == 0
    named = [(n, t.detach()) for n, t in new_model.state_dict().items()]
    refused = engine.post("/update_weights_from_tensor",
                          {"serialized_named_tensors": [encode(named[:1])]})
    assert refused.status_code == 400 and "resume_memory_occupation" in message(refused)
    assert sender.resume(["weights"])[0]["released"] == ["cuda_graph", "kv_cache"]
    assert sender.send([named[:4], named[4:]], "c1")[0] == 2
    assert sender.resume(None)[0]["released"] == []
    waiting.join(timeout=60)
    assert out["output_ids"] == want and out["meta_info"]["weight_version"] == "c1"
    assert engine.get("/get_server_info").json()["memory_released"] == []
    sender.close()


def test_flattened_bucket_and_refusals(engine: EngineProcess, new_model: Any) -> None:
    name = "model.norm.weight"
    tensor = torch.full_like(new_model.state_dict()[name], 0.25)
    flat = tensor.flatten().clone().share_memory_()
    meta = [FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, 0, flat.numel(),
                                    flat.numel())]
    payload = _pickle({"flattened_tensor": flat, "metadata": meta})
    reply = engine.post("/update_weights_from_tensor", {
        "serialized_named_tensors": [payload], "load_format": "flattened_bucket",
        "weight_version": "flat"})
    assert reply.status_code == 200, reply.text
    assert engine.post("/get_weights_by_name", {"name": name}).json() == [0.25] * flat.numel()

    def refused(body: dict[str, Any]) -> str:
        reply = engine.post("/update_weights_from_tensor", body)
        assert reply.status_code == 400, reply.text
        return message(reply)

    ok = encode([(name, tensor)])
    assert "base64" in refused({"serialized_named_tensors": ["%%"]})
    assert "one entry" in refused({"serialized_named_tensors": [ok, ok]})
    assert "load_format 'safetensors'" in refused({"serialized_named_tensors": [ok],
                                                   "load_format": "safetensors"})
    evil = base64.b64encode(pickle.dumps(print)).decode()  # any callable but torch's rebuilders
    assert "builtins.print" in refused({"serialized_named_tensors": [evil]})
    legacy = io.BytesIO()  # the engine's former torch.save form: SGLang never took it
    torch.save([(name, tensor)], legacy)
    assert "multiprocessing pickle" in refused(
        {"serialized_named_tensors": [base64.b64encode(legacy.getvalue()).decode()]})
    assert "unknown parameter" in refused(
        {"serialized_named_tensors": [encode([("model.nope", tensor)])]})
    assert "shape of model.norm.weight" in refused(
        {"serialized_named_tensors": [encode([(name, tensor[:3])])]})
    assert "dict with keys" in refused({"serialized_named_tensors": [ok],
                                        "load_format": "flattened_bucket"})
    short = [FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, 0, 3, 3)]
    assert "do not hold shape" in refused({
        "serialized_named_tensors": [_pickle({"flattened_tensor": flat, "metadata": short})],
        "load_format": "flattened_bucket"})
    tags = engine.post("/release_memory_occupation", {"tags": ["gpu"]})
    assert tags.status_code == 400 and "unknown memory tag" in message(tags)
    assert engine.get("/get_server_info").json()["memory_released"] == []


def _pickle(obj: Any) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as torch_mp

    torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_repeated_syncs_reuse_the_mappings(engine: EngineProcess, new_model: Any) -> None:
    """The sender re-sends each bucket's pickle; the engine keeps it mapped from its second
    arrival on, a new buffer replaces it, a release drops it, and the weights stay exact."""
    named = [(n, t.detach()) for n, t in new_model.state_dict().items()]
    plan = [named[:4], named[4:]]

    def stats() -> dict[str, int]:
        return dict(engine.get("/get_server_info").json()["shared_tensors"])

    def sync_and_check(sender: ColocatedWeightSender, version: str) -> None:
        scale = float(version.split("-")[-1])  # every sync its own weights
        sender.send([[(n, t * scale) for n, t in bucket] for bucket in plan], version)
        want = {n: t * scale for n, t in named}
        for name in (named[0][0], named[-1][0]):
            got = torch.tensor(engine.post("/get_weights_by_name", {"name": name}).json())
            assert torch.equal(got, want[name][:len(got)])  # the engine sends the first rows

    start = stats()
    sender = ColocatedWeightSender([engine.url], torch.float32, timeout_s=60)
    # The second bucket is the larger: the staging buffer grows during the first sync, so the
    # first bucket's pickle changes once; from then on every payload is the same.
    for i, (opened, reused) in enumerate([(2, 0), (4, 0), (5, 1), (5, 3), (5, 5)]):
        sync_and_check(sender, f"r-{1 + i * 0.25}")
        now = stats()
        assert (now["num_opened"] - start["num_opened"],
                now["num_reused"] - start["num_reused"]) == (opened, reused), now
    assert now["num_entries"] == 2
    other = ColocatedWeightSender([engine.url], torch.float32, timeout_s=60)
    sync_and_check(other, "r-0.5")  # new buffers: their payloads replace the kept ones
    assert stats()["num_entries"] == 0
    sync_and_check(other, "r-0.75")
    sync_and_check(other, "r-0.625")  # its buffer grew in its first sync too
    assert stats()["num_entries"] == 2
    other.release(["kv_cache"])
    assert stats()["num_entries"] == 0  # any release drops them
    other.resume(None)
    before = stats()["num_opened"]
    sync_and_check(other, "r-1")  # known payloads: kept again at once
    assert stats()["num_entries"] == 2 and stats()["num_opened"] == before + 2
    # Greedy log-probs after the repeated syncs equal the model's own.
    out = engine.generate(PROMPT, sampling_params=GREEDY, return_logprob=True)
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        logits = new_model(ids).logits[0, len(PROMPT) - 1:-1]
    ours = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT):, None])[:, 0]
    engine_lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(engine_lps, ours, atol=1e-4), (engine_lps, ours)
    # A payload naming an unknown parameter still fails clearly, however often it comes.
    bad = encode([("model.nope", named[0][1])])
    for _ in range(3):
        reply = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [bad]})
        assert reply.status_code == 400 and "unknown parameter name 'model.nope'" in message(reply)
    sender.close()
    other.close()


def test_live_storages_go_as_they_are_and_are_read_in_place(engine: EngineProcess,
                                                            new_model: Any) -> None:
    """Tensors that stay the same storages (in shared memory here, as CUDA tensors would be
    on a GPU) are sent as they are: the engine keeps their payload and reads the values the
    trainer wrote in place since."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    params = [(n, t.detach().clone().share_memory_()) for n, t in new_model.state_dict().items()]
    originals = [t.clone() for _, t in params]
    sender = ColocatedWeightSender([engine.url], torch.float32, timeout_s=60)
    start = engine.get("/get_server_info").json()["shared_tensors"]
    for step in range(4):
        for (_, tensor), original in zip(params, originals, strict=True):
            tensor.copy_(original * (1 + step / 8))  # the trainer's step, in place
        sender.send([params[:4], params[4:]], f"live-{step}")
        got = torch.tensor(engine.post("/get_weights_by_name", {"name": params[-1][0]}).json())
        assert torch.equal(got, params[-1][1][:len(got)])
    assert sender.shares.modes() == {"fresh": 0, "direct": 2, "staged": 0}
    assert sender.shares.num_bytes == 0  # no staging buffer
    now = engine.get("/get_server_info").json()["shared_tensors"]
    # A shared file pickles the same way every time, so sync 1's fresh payloads equal sync
    # 2's direct ones and are kept from sync 2 on (CUDA pickles differ: from sync 3 on).
    assert now["num_opened"] - start["num_opened"] == 4
    assert now["num_reused"] - start["num_reused"] == 4
    sender.close()
