"""The trainer's whole step on one GPU against transformers (sdpa) + AdamW on the same tokens.

For Qwen2-0.5B- and Qwen2-1.5B-shaped models (random weights, bf16, TP 1), each case is one
training step over the same token rows for both sides:

- `row2048`, `row8192`, `row32768`: 65,536 tokens a step, rows of 2,048 / 8,192 / 32,768
  tokens (micro-batches of 16,384 tokens, or one row each when longer); 32,768-token rows
  run with activation recomputation on both sides (megatron full/uniform/1 layer; HF
  gradient checkpointing);
- `packed`: 16 sequences of 4,096 tokens; the trainer packs them (THD, cu_seqlens) into
  micro-batches of 16,384 tokens, transformers runs them as [4, 4096] micro-batches: the
  lengths are equal, so its rows hold no padding (its best case, what a user would pick;
  packing cannot save it any work here);
- `mixed`: 16 sequences of 256..4,096 tokens (seeded): the trainer packs them as above,
  transformers gets right-padded rows, 4 a micro-batch, longest first (padding computed).

The trainer side is its own path: `build_gpt_model` (fused attention; its layers compiled as
`[trainer.model] compile_layers = "auto"` does on a GPU, `--compile off` eager; `on,off` runs
both, and `compile_check` holds the compiled layers' log-probs and gradients against eager
ones) -> `MasterAdam` on the GPU -> `step.train_step` (clipped PG loss, chunked log-probs,
with `--fused-output on` the output layer fused into them, one minibatch). The baseline:
`AutoModelForCausalLM.from_config(attn_implementation="sdpa")` in bf16, per-token log-probs
from log_softmax of the fp32 logits, the same `policy_loss`, grad clipping and
`torch.optim.AdamW(fused=True)`. Each side runs in its own process (clean peak memory), one
warm-up step then `--steps` timed steps; tokens/s counts real tokens over the median step.
MFU = model FLOPs / step time / 989e12 (H100/H200 dense bf16 peak), model FLOPs = 6 * N_mm *
tokens + 6 * L * heads * head_dim * sum(S_i^2) (N_mm: the matmul parameters of the layers
and the output layer; the causal attention's fwd+bwd; recomputation not counted).
The last line printed is the JSON summary.

    python bench/trainer_gpu.py [--shapes 0.5b,1.5b] [--cases row2048,row8192,row32768,packed,mixed]
        [--steps 3] [--fused-output auto|on|off] [--compile on|off|on,off]
        [--checks on|compile|off] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12
STEP_TOKENS = 65536
MICRO_TOKENS = 16384
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}
CASES = ("row2048", "row8192", "row32768", "packed", "mixed")


def _hf_config(shape: str) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, **SHAPES[shape])  # fmt: skip


def sequences(case: str) -> tuple[list[int], bool]:
    """(sequence lengths, whether recomputation is on) of a case."""
    import random

    if case.startswith("row"):
        length = int(case[3:])
        return [length] * (STEP_TOKENS // length), length > 16384
    if case == "packed":
        return [4096] * 16, False
    rng = random.Random(0)
    return [rng.randint(256, 4096) for _ in range(16)], False


def model_flops(shape: str, lengths: list[int]) -> float:
    c = SHAPES[shape]
    h, heads, kv, ffn = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                         c["intermediate_size"])  # fmt: skip
    d = h // heads
    layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * ffn
    n_mm = c["num_hidden_layers"] * layer + h * 151936
    attention = 6 * c["num_hidden_layers"] * heads * d * sum(s * s for s in lengths)
    return 6.0 * n_mm * sum(lengths) + attention


def _micro_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of the sequences in each micro-batch (longest first, <= MICRO_TOKENS each,
    counted as padded width x rows, the same rule as the trainer's batch.py)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= MICRO_TOKENS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _pack_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of the sequences in each packed micro-batch (longest first, <= MICRO_TOKENS
    real tokens each, batch.py's packed rule)."""
    groups: list[list[int]] = []
    used = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and used + lengths[i] <= MICRO_TOKENS:
            groups[-1].append(i)
            used += lengths[i]
        else:
            groups.append([i])
            used = lengths[i]
    return groups


def _tokens(lengths: list[int], vocab: int, device: Any) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]


def _timed_steps(step: Any, steps: int) -> tuple[list[float], float]:
    import torch

    step()  # warm-up (kernel selection, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, torch.cuda.max_memory_allocated() / 2**30


KERNEL_KINDS = (("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
                ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("compiled", ("triton_",)))


def _kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lower for mark in marks):
            return kind
    return "other"


def profile_step(step: Any, path: Path) -> dict[str, Any]:
    """One `step` under torch.profiler: the GPU's busy time (union of kernel, copy and memset
    intervals) against the span from first to last, the kernel count, time by kind of
    kernel; the 40 costliest kernels go to `path` (JSON), the host's costliest operations
    (self time) beside it (`.txt`), the operations costliest on the GPU by input shapes too
    (`.shapes.txt`: which layer's matmul is which)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                      max_name_column_width=70)  # fmt: skip
    path.with_suffix(".txt").write_text(table)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_device_time_total", row_limit=60, max_name_column_width=40,
        max_shapes_column_width=110)
    path.with_suffix(".shapes.txt").write_text(shapes)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    busy, end = 0.0, float("-inf")
    by_name: dict[str, list[float]] = {}
    by_kind: dict[str, float] = {}
    for start, stop, name in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += stop - start
        kind = _kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + stop - start
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    path.write_text(json.dumps([{"name": n[:160], "calls": c, "ms": round(t / 1e3, 3)}
                                for n, (c, t) in top], indent=1))  # fmt: skip
    return {"gpu_busy_ms": round(busy / 1e3, 1),
            "span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 1) if spans else 0.0,
            "kernels": len(spans),
            "ms_by_kind": {k: round(v / 1e3, 1) for k, v in sorted(by_kind.items())}}  # fmt: skip


def _case_result(shape: str, case: str, times: list[float], peak: float) -> dict[str, Any]:
    lengths, recompute = sequences(case)
    median = statistics.median(times)
    return {
        "tokens": sum(lengths), "step_s": round(median, 4),
        "tokens_per_s": round(sum(lengths) / median, 1),
        "mfu": round(model_flops(shape, lengths) / median / PEAK_FLOPS, 4),
        "peak_gib": round(peak, 2), "recompute": recompute,
    }


def _micro_batch(seqs: list[Any], packed: bool) -> Any:
    import torch

    from services.trainer.data.batch import MicroBatch

    lengths = [len(s) for s in seqs]
    if packed:
        ids = torch.cat(seqs).unsqueeze(0)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
    else:
        ids = torch.zeros((len(seqs), max(lengths)), dtype=torch.long, device=seqs[0].device)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = s
        cu = None
    mask = (ids != -1).float()
    if not packed:
        for row, n in enumerate(lengths):
            mask[row, n:] = 0
    gen = torch.Generator(device=ids.device).manual_seed(1)
    adv = torch.randn(ids.shape, generator=gen, device=ids.device)
    return MicroBatch(ids, mask, torch.full(ids.shape, -3.0, device=ids.device), adv, lengths, cu)


def run_trainer(shape: str, cases: list[str], steps: int, fused_output: str = "auto",
                compile_mode: str = "on", profile_dir: str = "") -> dict[str, Any]:  # fmt: skip
    import functools

    import torch

    from services.trainer.data.batch import RolloutBatch
    from services.trainer.model.layer_compile import compile_layers
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model.policy import ModelPolicy
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.objective.loss import LossSettings
    from services.trainer.optim.optimizer_stream import MasterAdam, megatron_no_decay
    from services.trainer.parallel.parallel import init_parallel
    from services.trainer.step import train_step

    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=29611)
    model_shape = ModelShape.from_hf(_hf_config(shape))
    model = build_gpt_model(model_shape, dtype="bfloat16", attention="fused")
    if compile_mode == "on":
        compile_layers(model)  # [trainer.model] compile_layers (auto: on on a GPU)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = MasterAdam([p for _, p in named], lr=1e-6, no_decay=megatron_no_decay(named))
    fused = None if fused_output == "auto" else fused_output == "on"
    policy = ModelPolicy(model, optimizer, functools.partial(token_logprobs, fused=fused), 1.0)
    config = model.config
    out: dict[str, Any] = {}
    for case in cases:
        lengths, recompute = sequences(case)
        # the [trainer.model] recompute_* settings; megatron reads them at each forward
        config.recompute_granularity = "full" if recompute else None
        config.recompute_method = "uniform" if recompute else None
        config.recompute_num_layers = 1 if recompute else None
        seqs = _tokens(lengths, model_shape.vocab_size, torch.device("cuda"))
        packed = case in ("packed", "mixed")
        groups = _pack_groups(lengths) if packed else _micro_groups(lengths)
        micro = [_micro_batch([seqs[i] for i in g], packed) for g in groups]
        batch = RolloutBatch(micro, [], [], [])
        try:
            def step(b: RolloutBatch = batch) -> None:
                train_step(policy, b, LossSettings())

            times, peak = _timed_steps(step, steps)
            out[case] = _case_result(shape, case, times, peak) | {"micro_batches": len(micro)}
            if profile_dir:
                name = f"trainer_{compile_mode}_{shape}_{case}.json"
                out[case]["profile"] = profile_step(step, Path(profile_dir) / name)
        except torch.OutOfMemoryError as err:
            out[case] = {"error": f"out of memory: {str(err)[:120]}"}
        except Exception as err:  # noqa: BLE001 - reported in the JSON; the other cases still run
            out[case] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        torch.cuda.empty_cache()
    return out


def run_hf(shape: str, cases: list[str], steps: int, profile_dir: str = "") -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.objective.loss import LossSettings, policy_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        _hf_config(shape), attn_implementation="sdpa", dtype=torch.bfloat16
    ).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    out: dict[str, Any] = {}
    for case in cases:
        lengths, recompute = sequences(case)
        if recompute:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        seqs = _tokens(lengths, 151936, torch.device("cuda"))
        micro = [_micro_batch([seqs[i] for i in g], False) for g in _micro_groups(lengths)]
        total = sum(int(mb.loss_mask.sum()) for mb in micro)

        def step(micro: list[Any] = micro, total: int = total) -> None:
            for mb in micro:
                logits = model(input_ids=mb.input_ids).logits
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                lp = torch.zeros(mb.input_ids.shape, device=logits.device)
                lp[:, 1:] = logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
                del logits, logp
                loss, _ = policy_loss(lp, lp.detach(), mb.rollout_logprobs, mb.advantages,
                                      mb.loss_mask, LossSettings())  # fmt: skip
                (loss * (mb.num_loss_tokens / total)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            times, peak = _timed_steps(step, steps)
            out[case] = _case_result(shape, case, times, peak) | {"micro_batches": len(micro)}
            if profile_dir:
                name = f"hf_{shape}_{case}.json"
                out[case]["profile"] = profile_step(step, Path(profile_dir) / name)
        except torch.OutOfMemoryError as err:
            out[case] = {"error": f"out of memory: {str(err)[:120]}"}
        except Exception as err:  # noqa: BLE001 - reported in the JSON; the other cases still run
            out[case] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    return out


def optimizer_check() -> dict[str, Any]:
    """The device-resident MasterAdam against the host-resident one, 3 steps, on the GPU."""
    import torch

    from services.trainer.optim.optimizer_stream import MasterAdam

    torch.manual_seed(0)
    base = [torch.randn(n, dtype=torch.bfloat16) for n in (4097, 333, 70000)]
    gpu = [p.cuda().requires_grad_() for p in base]
    cpu_side = [p.cuda().requires_grad_() for p in base]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "bucket_mb": 0.1}
    dev_opt = MasterAdam(gpu, **kw)  # type: ignore[arg-type]
    host_opt = MasterAdam(cpu_side, device=torch.device("cpu"), **kw)  # type: ignore[arg-type]
    diffs = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(gpu, cpu_side, strict=True):
            g = torch.randn(a.shape, generator=gen).to(torch.bfloat16).cuda()
            a.grad, b.grad = g.clone(), g.clone()
        dev_opt.step()
        host_opt.step()
        diffs.append(max(float((a.float() - b.float()).abs().max())
                         for a, b in zip(gpu, cpu_side, strict=True)))  # fmt: skip
    return {"device_vs_host_max_abs_diff_per_step": diffs, "fused": dev_opt.fused,
            "state_device": str(dev_opt.device)}


def logprob_kernel_check() -> dict[str, Any]:
    """The triton log-prob kernels against chunked_logprobs.py's torch chunks, bf16 logits of
    a 151,936 vocabulary at T = 0.8 (forward and gradient max abs differences)."""
    import torch

    from services.trainer.objective import chunked_logprobs, logprob_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(3000, 151936, device="cuda", generator=gen)).bfloat16()
    targets = torch.randint(0, 151936, (3000,), device="cuda", generator=gen)
    grad = torch.randn(3000, device="cuda", generator=gen)
    lse, picked = logprob_kernels.row_lse_and_target(logits, targets, 0.8)
    ref_lse, ref_picked = chunked_logprobs._torch_lse_and_target(logits, targets, 0.8, 512)
    ours = logprob_kernels.row_grad(logits, targets, lse, grad, 0.8)
    ref = chunked_logprobs._torch_grad(logits, targets, ref_lse, grad, 0.8, 512)
    return {"logprob_max_abs_diff": float(((picked - lse) - (ref_picked - ref_lse)).abs().max()),
            "grad_max_abs_diff": float((ours.float() - ref.float()).abs().max()),
            "grad_max_abs": float(ref.float().abs().max())}  # fmt: skip


def rope_kernel_check() -> dict[str, Any]:
    """rope.py's compiled rotation against megatron's eager RoPE, bf16 queries of a packed
    row [8192, 14, 64] (four sequences), forward and gradient max abs differences."""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from services.trainer.attention import rope

    gen = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(8192, 14, 64, device="cuda", generator=gen).bfloat16().requires_grad_()
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    angles = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    cu = torch.tensor([0, 1000, 4096, 5000, 8192], dtype=torch.int32)
    upstream = torch.randn(t.shape, device="cuda", generator=gen).bfloat16()
    got = rope.rope_thd(t, cu, freqs)
    (got_grad,) = torch.autograd.grad((got * upstream).float().sum(), t)
    rows = freqs.index_select(0, rope.thd_positions(cu, freqs.device))
    want = _apply_rotary_pos_emb_bshd(t.unsqueeze(1), rows).squeeze(1)
    (want_grad,) = torch.autograd.grad((want * upstream).float().sum(), t)
    return {"rope_max_abs_diff": float((got - want).float().abs().max()),
            "rope_grad_max_abs_diff": float((got_grad - want_grad).float().abs().max()),
            "rope_max_abs": float(want.float().abs().max())}  # fmt: skip


def fused_output_check() -> dict[str, Any]:
    """fused_output.py's output layer + log-prob against logits then the chunked log-probs,
    bf16 hidden states [3000, 896] and a 151,936 x 896 weight at T = 0.8 (max abs
    differences of the log-probs and of both gradients, and the gradients' scale)."""
    import torch

    from services.trainer.objective.chunked_logprobs import target_logprobs
    from services.trainer.objective.fused_output import hidden_logprobs

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 896, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.05 * torch.randn(151936, 896, device="cuda", generator=gen)).bfloat16()
    weight.requires_grad_()
    targets = torch.randint(0, 151936, (3000,), device="cuda", generator=gen)
    upstream = torch.randn(3000, device="cuda", generator=gen)
    got = hidden_logprobs(hidden, weight, targets, 0.8, chunk_tokens=1024)
    got_h, got_w = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    want = target_logprobs(hidden @ weight.t(), targets, 0.8)
    want_h, want_w = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    return {"logprob_max_abs_diff": float((got - want).abs().max()),
            "grad_hidden_max_abs_diff": float((got_h - want_h).float().abs().max()),
            "grad_hidden_max_abs": float(want_h.float().abs().max()),
            "grad_weight_max_abs_diff": float((got_w - want_w).float().abs().max()),
            "grad_weight_max_abs": float(want_w.float().abs().max())}  # fmt: skip


def compile_check() -> dict[str, Any]:
    """Compiled layers (layer_compile.py) against the same model eager: log-probs and weight
    gradients of a 4-layer Qwen2-0.5B-wide model in bf16, on a packed row of sequences of
    1,500, 700 and 300 tokens and on a shared-prefix row of the same tokens (max abs
    differences, and the scale of what they differ in)."""
    import torch

    from services.trainer.model.layer_compile import compile_layers
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.parallel.parallel import init_parallel

    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=29612)
    config = _hf_config("0.5b")
    config.num_hidden_layers = 4
    shape = ModelShape.from_hf(config)
    model = build_gpt_model(shape, dtype="bfloat16", attention="fused")
    ids = torch.randint(0, 151936, (1, 2500), generator=torch.Generator().manual_seed(0)).cuda()
    rows = {"packed": ([0, 1500, 2200, 2500], None), "shared_prefix": ([0, 1500, 2200, 2500],
                                                                       [-1, 0, 0])}
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)).cuda()

    def run() -> dict[str, tuple[Any, dict[str, Any]]]:
        out = {}
        for name, (cu, prefix_of) in rows.items():
            model.zero_grad()
            lp = token_logprobs(model, ids, cu_seqlens=cu, prefix_of=prefix_of)
            (lp * weights).sum().backward()
            out[name] = (lp.detach(), {n: p.grad.detach().clone()
                                       for n, p in model.named_parameters()})  # fmt: skip
        return out

    eager = run()
    compile_layers(model)
    compiled = run()
    report: dict[str, Any] = {}
    for name in rows:
        (lp_e, g_e), (lp_c, g_c) = eager[name], compiled[name]
        report[name] = {
            "logprob_max_abs_diff": float((lp_e - lp_c).abs().max()),
            "logprob_max_abs": float(lp_e.abs().max()),
            "grad_max_rel_diff": max(float((g_e[n] - g_c[n]).float().abs().max()
                                           / g_e[n].float().abs().max().clamp_min(1e-12))
                                     for n in g_e)}  # fmt: skip
    return report


def child(args: argparse.Namespace) -> None:
    if args.child == "compile_check":
        print(json.dumps(compile_check()), flush=True)
        return
    cases = args.cases.split(",")
    if args.child.startswith("trainer"):
        out = run_trainer(args.shape, cases, args.steps, args.fused_output, args.compile,
                          args.profile)  # fmt: skip
    else:
        out = run_hf(args.shape, cases, args.steps, args.profile)
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--compile", default="on",
                        help="[trainer.model] compile_layers for the trainer: on or off; both "
                        "(on,off) run as sides trainer and trainer_off")
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--profile", default="",
                        help="a folder: profile one more step of each case and side there "
                        "(GPU busy time, span, time by kernel kind in the JSON; top kernels "
                        "in a file each)")
    parser.add_argument("--checks", choices=["on", "compile", "off"], default="on",
                        help="compile: only compile_check; off: time the cases only")
    parser.add_argument("--fused-output", choices=["auto", "on", "off"], default="auto",
                        help="[trainer.model] fused_output_logprobs (auto: off on a GPU)")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "fused_output_logprobs": args.fused_output,
                               "mfu_formula": "(6*N_mm*tokens + 6*L*heads*head_dim*sum(S^2))"
                               f" / step_s / {PEAK_FLOPS:.0f}", "shapes": {}}  # fmt: skip
    if args.checks == "on":
        results["optimizer_check"] = optimizer_check()
        results["logprob_kernel_check"] = logprob_kernel_check()
        results["fused_output_check"] = fused_output_check()
        results["rope_kernel_check"] = rope_kernel_check()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.checks != "off" and "on" in args.compile.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", "compile_check"],
                              capture_output=True, text=True, env=env)  # fmt: skip
        lines = proc.stdout.strip().splitlines()
        results["compile_check"] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                                    else {"error": proc.stderr[-600:]})
        print("compile_check", json.dumps(results["compile_check"]), flush=True)
    for shape in args.shapes.split(","):
        sides = {}
        modes = args.compile.split(",")
        for side, mode in [("trainer", modes[0]), *[(f"trainer_{m}", m) for m in modes[1:]],
                           ("hf", "off")]:
            cmd = [sys.executable, __file__, "--child", side, "--shape", shape,
                   "--cases", args.cases, "--steps", str(args.steps)]  # fmt: skip
            cmd += ["--fused-output", args.fused_output, "--compile", mode]
            cmd += ["--profile", args.profile] if args.profile else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode or not lines:
                sys.stderr.write(proc.stderr[-4000:])
                sides[side] = {"error": f"exit {proc.returncode}: {proc.stderr[-300:]}"}
            else:
                sides[side] = json.loads(lines[-1])
            print(shape, side, json.dumps(sides[side]), flush=True)
        speedups = {}
        for side in sides:
            if not side.startswith("trainer"):
                continue
            ratios = {}
            for case in args.cases.split(","):
                ours, theirs = sides[side].get(case, {}), sides["hf"].get(case, {})
                if "tokens_per_s" in ours and "tokens_per_s" in theirs:
                    ratios[case] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
                else:
                    ratios[case] = None
            speedups["speedup" + side[len("trainer"):]] = ratios
        results["shapes"][shape] = {**sides, **speedups}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
