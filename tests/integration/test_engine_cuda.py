"""The built-in engine on CUDA: slots decode replayed from CUDA graphs computes what the
transformers forward computes, follows weights copied in place, and a real engine process
(auto backend: slots + graphs) decodes concurrent requests as transformers' greedy does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from services.engine.decode_graphs import DecodeGraphs, width_bucket
from services.engine.prefill_graphs import PrefillGraphs
from services.engine.slot_kv import SlotKV
from services.engine.slot_model import PrefillRow, SlotModel
from services.testing.engine_process import EngineProcess, tiny_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CUDA = torch.device("cuda")


def qwen2_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config).eval()
    for param in model.parameters():
        param.data.normal_(0, 0.2)
    return model.to(CUDA)


def reference_last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens], device=CUDA)).logits[0, -1]


def test_graph_replay_matches_transformers_and_follows_weight_copies() -> None:
    model = qwen2_model()
    kv = SlotKV(num_layers=2, num_slots=8, slot_len=300, kv_heads=2, head_dim=16,
                dtype=torch.float32, device=CUDA)
    slot_model = SlotModel(model, kv)
    graphs = DecodeGraphs(slot_model, 8)
    gen = torch.Generator().manual_seed(2)
    sequences, slots = [], []
    for n in (3, 40, 150, 7, 250):  # five rows: batch bucket 8 with three padding rows
        slot = kv.allocate()
        tokens = torch.randint(0, 97, (n,), generator=gen).tolist()
        slot_model.prefill([PrefillRow(slot, tokens, 0, all_logits=False)])
        sequences.append(tokens)
        slots.append(slot)
    for step in range(30):
        if step == 15:  # a weight update copies in place: the captured graphs must see it
            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.weight.mul_(-1.5)
        lengths = [len(s) for s in sequences]
        nexts = [int(torch.randint(0, 97, (), generator=gen)) for _ in sequences]
        width = width_bucket(max(lengths) + 1, kv.slot_len)
        logits = graphs.run(nexts, lengths, slots, width).float()
        for row, token in enumerate(nexts):
            sequences[row].append(token)
            want = reference_last_logits(model, sequences[row])
            torch.testing.assert_close(logits[row], want, rtol=2e-3, atol=2e-3)
    assert graphs.num_graphs == 2  # (8, 256) then (8, 300) once the longest row passed 255


def test_prefill_graph_replays_match_transformers_after_cached_prefixes() -> None:
    model = qwen2_model()
    kv = SlotKV(num_layers=2, num_slots=8, slot_len=300, kv_heads=2, head_dim=16,
                dtype=torch.float32, device=CUDA)
    slot_model = SlotModel(model, kv)
    graphs = PrefillGraphs(slot_model, use_graphs=True)
    gen = torch.Generator().manual_seed(4)
    sequences = {slot: torch.randint(0, 97, (n,), generator=gen).tolist()
                 for slot, n in ((kv.allocate(), 30), (kv.allocate(), 120), (kv.allocate(), 5))}
    for slot, tokens in sequences.items():  # the cached prefixes, eagerly
        slot_model.prefill([PrefillRow(slot, tokens, 0, all_logits=False)])
    for turn in range(3):  # each turn: new pieces over the prefixes, one replay
        rows = []
        for slot, tokens in sequences.items():
            piece = torch.randint(0, 97, (3 + 11 * turn + slot,), generator=gen).tolist()
            rows.append(PrefillRow(slot, piece, len(tokens), all_logits=False))
            tokens += piece
        key = graphs.key(rows)
        assert key is not None and key[0] == 4
        logits = graphs.prefill(rows, key)
        for row, out in zip(rows, logits, strict=True):
            want = reference_last_logits(model, sequences[row.slot])
            torch.testing.assert_close(out[0].float(), want, rtol=2e-3, atol=2e-3)
    assert 1 <= graphs.num_graphs <= 3 and not graphs.failed


def test_engine_process_decodes_concurrent_requests_as_transformers(tmp_path: Path) -> None:
    path = tiny_model_path(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(CUDA).eval()
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(12)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    args = ["--device", "cuda", "--dtype", "float32", "--max-running-requests", "16",
            "--max-total-tokens", "8192"]
    with EngineProcess(path, extra_args=args, start_timeout_s=300) as engine:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: engine.generate(p, sampling_params=params), prompts))
        info = engine.get("/server_info").json()
        log = engine.log_tail(20000)
    assert "decode backend: slots" in log and "captured" in log
    assert info["context_length"] == 512  # 8192 tokens over 16 slots
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(params["max_new_tokens"]):
                ids.append(int(model(torch.tensor([ids], device=CUDA)).logits[0, -1].argmax()))
        assert out["output_ids"] == ids[len(prompt):]
