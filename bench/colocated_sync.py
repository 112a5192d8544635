"""Colocated weight sync: seconds per sync through CUDA IPC handles against a plain
device-to-device copy of the same bytes, in the same run.

A built-in engine process holds a randomly initialised model of Qwen2-1.5B's shape (bf16, no
download); this process plays the trainer with other random weights of the same shape on the
same GPU and sends them with `ColocatedWeightSender` (buckets of `--bucket-mb`, SGLang's
`/update_weights_from_tensor` payload; its tensors are the same live storages every sync, so
they go as they are; with `--stage` they are copied into the persistent staging buffer
instead, as a trainer's freshly gathered tensors are; with `--sender-flat` they sit back to
back in one buffer in checkpoint order, the engine's own layout (engine/flat_weights.py), so
the engine loads a bucket as one copy: `engine_last_load` says how many copies a load took).
Measured: one colocated cycle
(release all, resume weights, sync, resume KV cache with graph capture) with the device's
free memory before and after the release, whose sync is the first one (cold: pickling,
opening the handles); then two warm-up syncs (the payload pickled for good, the engine
opening it again and keeping it) and `--repeats` steady-state syncs, and their median; the
median of the same bytes copied device to device as one flat buffer, tensor by tensor, in one
`torch._foreach_copy_` and by the engine's own copy (weight_copy.py), and the ratios; an update
that carries no tensor (its fixed cost), a bare HTTP round trip and one with a turn of the
engine loop; the engine's
log-probs of a greedy continuation against the trainer's own after the syncs (max abs diff),
and the weights read back from the engine against the trainer's (exact). JSON on the last
line.

    python bench/colocated_sync.py --device cuda              # Qwen2-1.5B shape, bf16
    python bench/colocated_sync.py --device cuda --stage      # the staged path
    python bench/colocated_sync.py --device cuda --sender-flat  # sender in the engine's layout
    python bench/colocated_sync.py --device cpu --shape tiny  # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tensor_payload import encode  # noqa: E402
from services.common.tiny_model import build_tokenizer  # noqa: E402
from services.engine.flat_weights import FlatWeights  # noqa: E402
from services.engine.weight_copy import copy_weights  # noqa: E402
from services.testing.engine_process import EngineProcess  # noqa: E402
from services.trainer.weights.weight_ipc import ColocatedWeightSender  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "tiny": dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
PROMPT = [(17 * i + 3) % 250 for i in range(32)]


def build_model(shape: str, seed: int, device: str) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=True, eos_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    for param in model.parameters():  # a wide spread: log-probs differ between seeds
        param.data.normal_(0, 0.05)
    return model.eval()


def hf_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors: the tied output embedding is not one of them."""
    seen: set[int] = set()
    named = []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        named.append((name, tensor.contiguous()))
    return named


def buckets(named: list[tuple[str, torch.Tensor]], bucket_mb: float
            ) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size, limit = 0, bucket_mb * 2**20
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def timed(fn: Any, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def free_gib(device: str) -> float | None:
    return round(torch.cuda.mem_get_info()[0] / 2**30, 2) if device == "cuda" else None


def engine_logprobs(engine: EngineProcess) -> tuple[list[int], list[float]]:
    out = engine.post("/generate", {
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }).json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def trainer_logprobs(model: Any, output_ids: list[int], device: str) -> list[float]:
    ids = torch.tensor([PROMPT + output_ids], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
    picked = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT):, None])
    return [float(x) for x in picked[:, 0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="qwen2-1.5b", choices=list(SHAPES))
    parser.add_argument("--bucket-mb", type=float, default=4096.0,
                        help="one bucket for Qwen2-1.5B (staged: the buffer holds it all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stage", action="store_true",
                        help="send tensors that need the staging copy (as a trainer's gathered "
                        "tensors do) instead of the same live storages")
    parser.add_argument("--sender-flat", action="store_true",
                        help="the trainer's parameters back to back in one buffer in checkpoint "
                        "order (flat_weights.py, the engine's own layout) instead of one "
                        "allocation each: the engine then loads a bucket as one copy")
    args = parser.parse_args()
    device = args.device
    with tempfile.TemporaryDirectory(prefix="colocated-bench-") as tmp:
        path = Path(tmp) / "model"
        started = time.perf_counter()
        build_model(args.shape, 0, device).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        trainer = build_model(args.shape, 1, device)
        if args.sender_flat:
            FlatWeights(trainer, torch.device(device))
        named = hf_tensors(trainer)
        plan = buckets(named, args.bucket_mb)
        total = sum(t.numel() * t.element_size() for _, t in named)
        setup_s = time.perf_counter() - started
        engine_args = ["--device", device, "--dtype", "bfloat16", "--max-running-requests", "8",
                       "--max-total-tokens", "16384", "--num-threads", "2"]
        with EngineProcess(path, extra_args=engine_args, start_timeout_s=600) as engine:
            sender = ColocatedWeightSender([engine.url], torch.bfloat16, timeout_s=600,
                                           direct=not args.stage)
            out_before, engine_before = engine_logprobs(engine)
            before = max(abs(a - b) for a, b in zip(
                engine_before, trainer_logprobs(trainer, out_before, device), strict=True))
            # One colocated cycle, as around a trainer step.
            cycle: dict[str, Any] = {"free_gib_before_release": free_gib(device)}
            cycle["release_s"] = timed(lambda: cycle.update(released=sender.release()[0]),
                                       device)
            cycle["free_gib_after_release"] = free_gib(device)
            cycle["resume_weights_s"] = timed(lambda: sender.resume(["weights"]), device)
            cycle["sync_s"] = timed(lambda: sender.send(plan, "cycle"), device)
            cycle["resume_kv_s"] = timed(
                lambda: cycle.update(resumed=sender.resume(["kv_cache"])[0]), device)
            cycle["free_gib_after_resume"] = free_gib(device)
            syncs = [timed(lambda i=i: sender.send(plan, f"v{i}"), device)
                     for i in range(args.repeats + 2)]
            phases = dict(sender.timings)
            last_load = engine.get("/get_server_info").json()["last_weight_load"]
            empty = encode([])  # the fixed cost of an update: HTTP, the engine loop's turn
            updates_empty = [timed(lambda: engine.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [empty], "flush_cache": False}), device)
                for _ in range(args.repeats)]
            # ... and what it is made of: a bare HTTP round trip, and one with a turn of the
            # engine loop (setting the version the last sync set)
            health = [timed(lambda: engine.get("/health"), device) for _ in range(args.repeats)]
            turns = [timed(lambda: engine.post("/update_weight_version", {
                "new_version": f"v{args.repeats + 1}", "abort_all_requests": False}), device)
                for _ in range(args.repeats)]
            staging_bytes, modes = sender.shares.num_bytes, sender.shares.modes()
            shared = engine.get("/get_server_info").json()["shared_tensors"]
            flat_src = torch.empty(total, dtype=torch.uint8, device=device)
            flat_dst = torch.empty_like(flat_src)
            copies = [timed(lambda: flat_dst.copy_(flat_src), device)
                      for _ in range(args.repeats)]
            clones = [torch.empty_like(t) for _, t in named]
            per_tensor = [timed(lambda: [c.copy_(t) for c, (_, t) in zip(clones, named,
                                                                          strict=True)], device)
                          for _ in range(args.repeats)]
            grouped = [timed(lambda: torch._foreach_copy_(clones, [t for _, t in named]), device)
                       for _ in range(args.repeats)]
            engines_copy = [timed(lambda: copy_weights(clones, [t for _, t in named]), device)
                            for _ in range(args.repeats)]
            out_after, engine_after = engine_logprobs(engine)
            ours = trainer_logprobs(trainer, out_after, device)
            diff = max(abs(a - b) for a, b in zip(engine_after, ours, strict=True))
            exact = all(torch.equal(  # the first 64 rows (or elements) of three tensors
                torch.tensor(engine.post("/get_weights_by_name",
                                         {"name": name, "truncate_size": 64}).json()),
                tensor[:64].float().cpu())
                for name, tensor in (named[0], named[len(named) // 2], named[-1]))
            version = engine.get("/get_model_info").json()["weight_version"]
            sender.close()
    steady = syncs[2:]  # once the payload is pickled for good and the engine keeps it
    sync_s, copy_s, tensor_copy_s, grouped_s, engine_copy_s, empty_s, health_s, turn_s = (
        statistics.median(x) for x in (steady, copies, per_tensor, grouped, engines_copy,
                                       updates_empty, health, turns))
    cold_s = cycle["sync_s"]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": args.shape, "dtype": "bfloat16",
        "num_params": sum(t.numel() for _, t in named), "num_tensors": len(named),
        "bytes": total, "bucket_mb": args.bucket_mb, "num_buckets": len(plan),
        "repeats": args.repeats, "setup_s": round(setup_s, 1),
        "staged": args.stage, "bucket_modes": modes, "staging_bytes": staging_bytes,
        "sync_cold_s": round(cold_s, 4), "sync_s": round(sync_s, 4),
        "syncs_s": [round(s, 4) for s in syncs],
        "sync_phases_s": {k: round(v, 5) for k, v in phases.items()},
        # the answer's round trip less the engine's open and load: HTTP and the loop's turn
        "sync_http_s": round(phases["post_s"] - phases["open_s"] - phases["load_s"], 5),
        "update_empty_s": round(empty_s, 5), "http_round_trip_s": round(health_s, 5),
        "http_with_loop_turn_s": round(turn_s, 5),
        "engine_shared_tensors": shared, "sender_flat": args.sender_flat,
        "engine_last_load": last_load,
        "d2d_copy_flat_s": round(copy_s, 5), "d2d_copy_per_tensor_s": round(tensor_copy_s, 5),
        "d2d_copy_foreach_s": round(grouped_s, 5), "d2d_copy_engine_s": round(engine_copy_s, 5),
        "sync_cold_over_flat_copy": round(cold_s / copy_s, 2),
        "sync_over_flat_copy": round(sync_s / copy_s, 2),
        "sync_over_per_tensor_copy": round(sync_s / tensor_copy_s, 2),
        "sync_gb_per_s": round(total / sync_s / 1e9, 1),
        "logprob_max_abs_diff_before_sync": round(before, 4),
        "logprob_max_abs_diff_after_sync": round(diff, 4),
        "weights_read_back_exact": exact, "engine_weight_version": version,
        "cycle": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in cycle.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
