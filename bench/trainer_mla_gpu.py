"""A GLM-5.2-shaped slice on one GPU: the trainer's step against transformers' GlmMoeDsa, and
the sparse MLA attention alone.

The slice is full width (hidden 6144, 64 heads, q LoRA 2048, kv LoRA 512, qk 192 + 64 rope,
v 256, DSA top-2048 from 32 index heads of 128, vocabulary 154,880): one dense layer (FFN
12,288) and `--moe-layers` MoE layers of `--experts` routed experts (FFN 2048, top 8, one
shared expert); layer 0 and 1 run indexers, layer 2 reuses layer 1's top-k. Both sides get the
same weights (transformers builds them seeded on the GPU; the trainer loads its state dict)
and one row of 8,192 / 32,768 / 65,536 tokens a step (recomputation at 32k and up: megatron
full/uniform/1 layer, transformers' gradient checkpointing), each case in its own process.
The trainer's step is `step.train_step` (clipped PG loss, chunked log-probs, MasterAdam on
the GPU); transformers' the same loss on log_softmax of its logits, AdamW(fused). One warm-up
step, then `--steps` timed; tokens/s over the median step. An out-of-memory is a result.

Sparse attention FLOPs (the absorbed form: 64 heads attend over one latent of 512 + 64 per
key, values its 512): for P valid (query, key) pairs (P = sum over queries of
min(position + 1, 2048)), forward 2 * P * heads * (576 + 512), backward
2 * P * heads * (3 * 576 + 2 * 512) (QK^T recomputed, dP, dV, dQ, dK); attention MFU =
(forward + backward) / attention seconds / 989e12 (H100/H200 dense bf16 peak). In the step,
the attention seconds are not separated: `attention_mfu_of_step` divides by the step time (a
lower bound).

`--attention-only` times the sparse attention kernels alone at `--seq` tokens (random
distinct causal picks, the worst case for locality), forward and backward for each backward
variant (`split-pairs`: the split one adding dKV in vector pairs), the split one's
two kernels apart, and the DSA indexer (fused Triton scores against the float32 torch form).

    python bench/trainer_mla_gpu.py [--cases row8192,row32768,row65536] [--sides trainer,hf]
        [--moe-layers 2] [--experts 16] [--steps 2] [--attention-backward split-pairs]
    python bench/trainer_mla_gpu.py --attention-only [--seq 65536]
        [--backward split,split-pairs,fused]
The last line printed is the JSON summary.
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
HEADS, LATENT, ROPE, TOPK = 64, 512, 64, 2048
BACKWARD_VARIANTS = ("split", "split-pairs", "fused")


def glm_slice_config(moe_layers: int, experts: int) -> Any:
    from transformers import GlmMoeDsaConfig

    layers = 1 + moe_layers
    return GlmMoeDsaConfig(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, n_shared_experts=1, n_routed_experts=experts,
        num_experts_per_tok=8, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=2048, kv_lora_rank=LATENT, qk_nope_head_dim=192,
        qk_rope_head_dim=ROPE, v_head_dim=256, index_topk=TOPK, index_n_heads=32,
        index_head_dim=128, max_position_embeddings=131072, rope_interleave=True,
        indexer_types=["full", "full"] + ["shared"] * (layers - 2), tie_word_embeddings=False,
        num_nextn_predict_layers=0, mlp_layer_types=["dense"] + ["sparse"] * moe_layers,
    )  # fmt: skip


def sparse_pairs(seq: int) -> int:
    """Valid (query, key) pairs of a causal row with top-`TOPK` selection."""
    full = min(seq, TOPK)
    return full * (full + 1) // 2 + (seq - full) * TOPK


def sparse_flops(seq: int) -> tuple[float, float]:
    pairs = sparse_pairs(seq)
    qk, pv = 2 * HEADS * (LATENT + ROPE), 2 * HEADS * LATENT
    return float(pairs * (qk + pv)), float(pairs * (3 * qk + 2 * pv))


def causal_picks(seq: int, device: Any, seed: int = 0) -> Any:
    """[1, seq, TOPK] distinct random causal picks (all earlier keys where fewer than TOPK),
    -1 padding."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.full((1, seq, TOPK), -1, dtype=torch.int32, device=device)
    keys = torch.arange(seq, device=device)
    for start in range(0, seq, 2048):
        end = min(seq, start + 2048)
        noise = torch.rand((end - start, seq), generator=gen, device=device)
        noise.masked_fill_(keys[None, :] > keys[start:end, None], -1.0)
        values, picks = noise.topk(min(TOPK, seq), dim=-1)
        out[0, start:end, : picks.size(1)] = torch.where(values >= 0, picks, -1).int()
    return out


def _time(fn: Any, repeat: int = 3) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def use_backward(variant: str) -> None:
    """Set the sparse attention's backward variant (`split-pairs`: the split one adding dKV in
    vector pairs, VECTOR_ATOMICS)."""
    from services.trainer.attention import sparse_mla_triton as kernels

    kernels.BACKWARD = variant.removesuffix("-pairs")
    kernels.VECTOR_ATOMICS = variant.endswith("-pairs")


def attention_only(seq: int, variants: list[str]) -> dict[str, Any]:
    import torch

    from services.trainer.attention import sparse_mla_triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq, HEADS, LATENT + ROPE, device="cuda", generator=gen,
                    dtype=torch.bfloat16)
    kv = torch.randn(1, seq, LATENT + ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    picks, positions = causal_picks(seq, "cuda"), torch.arange(seq, device="cuda")
    scale = (192 + ROPE) ** -0.5
    fwd_flops, bwd_flops = sparse_flops(seq)
    out, lse = kernels.forward(q, kv, picks, positions, scale, LATENT)
    grad = torch.randn(out.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    fwd_s = _time(lambda: kernels.forward(q, kv, picks, positions, scale, LATENT))
    result: dict[str, Any] = {
        "seq": seq, "topk": TOPK, "heads": HEADS, "pairs": sparse_pairs(seq),
        "forward_ms": round(fwd_s * 1e3, 2),
        "forward_tflops": round(fwd_flops / fwd_s / 1e12, 1),
    }  # fmt: skip
    result["indexer"] = indexer_timing(seq)
    print(json.dumps(result), flush=True)
    for variant in variants:
        use_backward(variant)
        try:
            bwd_s = _time(lambda: kernels.backward(grad, q, kv, picks, positions, out, lse,
                                                   scale))
        except Exception as err:  # noqa: BLE001 - reported in the JSON; the next variant runs
            result[variant] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            continue
        total = fwd_s + bwd_s
        result[variant] = {
            "backward_ms": round(bwd_s * 1e3, 2),
            "backward_tflops": round(bwd_flops / bwd_s / 1e12, 1),
            "fwd_bwd_ms": round(total * 1e3, 2),
            "attention_mfu": round((fwd_flops + bwd_flops) / total / PEAK_FLOPS, 4),
        }
        print(variant, json.dumps(result[variant]), flush=True)  # kept if a later one fails
    kernels.VECTOR_ATOMICS = False
    result["split_parts_ms"] = split_backward_parts(q, kv, picks, positions, out, lse, grad,
                                                    scale)
    result["configs"] = {name: str(getattr(k, "best_config", None)) for name, k in
                         (("forward", kernels._forward_kernel), ("dq", kernels._backward_kernel),
                          ("dkv", kernels._dkv_kernel))}  # fmt: skip
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def split_backward_parts(q: Any, kv: Any, picks: Any, positions: Any, out: Any, lse: Any,
                         grad: Any, scale: float) -> dict[str, float]:
    """The split backward's kernels timed apart (ms): dQ (scores and dP recomputed per head
    block), and dKV (all heads of a query, float32 atomics), each with the FLOPs it does."""
    import torch
    import triton

    from services.trainer.attention import sparse_mla_triton as kernels

    b, sq, h, _ = q.shape
    delta = (grad.float() * out.float()).sum(-1).contiguous()
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    idx, pos = picks.to(torch.int32).contiguous(), positions.to(torch.int32).contiguous()
    grid = lambda meta: (sq, b, triton.cdiv(h, meta["BLOCK_H"]))  # noqa: E731

    def dq() -> None:
        kernels._backward_kernel[grid](q, kv, idx, pos, grad, lse, delta, grad_q, grad_kv,
                                       scale, kv.size(1), h, idx.size(-1), D_V=LATENT, D_R=ROPE,
                                       WITH_DKV=False)

    def dkv() -> None:
        kernels._dkv_kernel[(sq, b)](q, kv, idx, pos, grad, lse, delta, grad_kv, scale,
                                     kv.size(1), h, idx.size(-1), D_V=LATENT, D_R=ROPE,
                                     HEADS=max(16, triton.next_power_of_2(h)),
                                     PAIRS=kernels.vector_pairs(q))

    pairs = sparse_pairs(sq)
    dq_s, dkv_s = _time(dq), _time(dkv)
    return {"dq_ms": round(dq_s * 1e3, 2), "dkv_ms": round(dkv_s * 1e3, 2),
            "dq_tflops": round(2 * pairs * h * (576 + 512 + 576) / dq_s / 1e12, 1),
            "dkv_tflops": round(2 * pairs * h * (576 + 512 + 576 + 512) / dkv_s / 1e12, 1)}


def indexer_timing(seq: int) -> dict[str, Any]:
    """The frozen DSA indexer's top-k of a `seq`-token row (seconds): through the fused Triton
    scores (the default on a GPU, `fused_s`; of which the scores alone, `fused_scores_s`) and
    through the torch form in float32 (`torch_s`), with the share of picks the two agree on."""
    import torch

    from services.trainer.attention import dsa_index_triton, sparse_attention
    from services.trainer.model.model import ModelShape

    shape = ModelShape.from_hf(glm_slice_config(1, 8))
    indexer = sparse_attention.DSAIndexer(shape).cuda().bfloat16()  # type: ignore[arg-type]
    for buf in indexer.buffers():
        buf.normal_(0, 0.02)
    hidden = torch.randn(seq, 1, 6144, device="cuda", dtype=torch.bfloat16)
    q_latent = torch.randn(seq, 1, 2048, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(seq, device="cuda")
    out: dict[str, Any] = {}
    fused = indexer(hidden, q_latent, positions)
    out["fused_s"] = round(_time(lambda: indexer(hidden, q_latent, positions)), 4)
    q = torch.randn(1, seq, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seq, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, seq, 32, device="cuda")
    chunk = sparse_attention._SCORE_BUDGET // seq

    def scores_only() -> None:
        for start in range(0, seq, chunk):
            dsa_index_triton.index_scores(q[:, start:start + chunk], k, w,
                                          positions[start:start + chunk], 128**-0.5)

    out["fused_scores_s"] = round(_time(scores_only), 4)
    supports = dsa_index_triton.supports
    dsa_index_triton.supports = lambda _q: False  # the torch form, as before the kernel
    try:
        reference = indexer(hidden, q_latent, positions)
        out["torch_s"] = round(_time(lambda: indexer(hidden, q_latent, positions), repeat=1), 3)
    finally:
        dsa_index_triton.supports = supports
    agree = 0
    for start in range(0, seq, 4096):
        picked = [torch.zeros(min(4096, seq - start), seq, dtype=torch.bool, device="cuda")
                  .scatter_(-1, x[0, start:start + 4096], True) for x in (fused, reference)]
        agree += int((picked[0] & picked[1]).sum())
    out["picks_agree"] = round(agree / reference.numel(), 6)
    out["config"] = str(getattr(dsa_index_triton._index_kernel, "best_config", None))
    return out


def _rows(seq: int, vocab: int) -> Any:
    import torch

    from services.trainer.data.batch import MicroBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=gen).cuda()
    adv = torch.randn(ids.shape, generator=gen).cuda()
    mask = torch.ones(ids.shape, device="cuda")
    return MicroBatch(ids, mask, torch.full(ids.shape, -3.0, device="cuda"), adv, [seq], None)


def _hf_model(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def profile_top(step: Any, count: int = 15) -> list[list[Any]]:
    """One more step under torch.profiler: its `count` costliest GPU kernels, as [name, ms
    in all calls, calls]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [[e.key[:80], round(e.device_time_total / 1e3, 2), e.count] for e in events[:count]]


def run_side(side: str, seq: int, moe_layers: int, experts: int, steps: int,
             profile: bool = False, attention_backward: str | None = None) -> dict[str, Any]:
    import torch

    from services.trainer.objective.loss import LossSettings, policy_loss

    config = glm_slice_config(moe_layers, experts)
    recompute = seq > 16384
    hf = _hf_model(config)
    batch = _rows(seq, config.vocab_size)
    if side == "trainer":
        if attention_backward:
            use_backward(attention_backward)
        from services.trainer.data.batch import RolloutBatch
        from services.trainer.model.model import ModelShape, build_gpt_model
        from services.trainer.model.policy import ModelPolicy
        from services.trainer.model_config import ParallelConfig
        from services.trainer.objective.logprobs import token_logprobs
        from services.trainer.optim.optimizer_stream import MasterAdam, megatron_no_decay
        from services.trainer.parallel.parallel import init_parallel
        from services.trainer.step import train_step
        from services.trainer.weights.convert import load_hf_weights

        init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=29631)
        shape = ModelShape.from_hf(config)
        full = {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}  # fmt: skip
        model = build_gpt_model(shape, dtype="bfloat16", recompute=full if recompute else None)
        load_hf_weights(model, shape, hf.state_dict())
        del hf
        torch.cuda.empty_cache()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = MasterAdam([p for _, p in named], lr=1e-6,
                               no_decay=megatron_no_decay(named))
        policy = ModelPolicy(model, optimizer, token_logprobs, 1.0)
        rollout = RolloutBatch([batch], [], [], [])

        def step() -> None:
            train_step(policy, rollout, LossSettings())
    else:
        hf.train()
        if recompute:
            hf.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=True)

        def step() -> None:
            ids = batch.input_ids
            logits = hf(input_ids=ids).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            lp = torch.zeros(ids.shape, device="cuda")
            lp[:, 1:] = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            del logits, logp
            loss, _ = policy_loss(lp, lp.detach(), batch.rollout_logprobs, batch.advantages,
                                  batch.loss_mask, LossSettings())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in (model if side == "trainer" else hf).parameters())
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    fwd, bwd = sparse_flops(seq)
    layers = 1 + moe_layers
    return {"step_s": round(median, 3), "tokens_per_s": round(seq / median, 1),
            "attention_mfu_of_step": round(layers * (fwd + bwd) / median / PEAK_FLOPS, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "recompute": recompute, "params": params, "times_s": [round(t, 3) for t in times],
            **({"profile_top_ms": profile_top(step)} if profile else {})}


def _subprocess(args: list[str], timeout_s: float) -> dict[str, Any]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    try:
        done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                              env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-6:]
        oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
        return {"error": "out of memory" if oom else "failed", "stderr_tail": tail}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attention-only", action="store_true")
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--backward", default="split,fused")
    parser.add_argument("--cases", default="row8192,row32768,row65536")
    parser.add_argument("--sides", default="trainer,hf")
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--profile", action="store_true",
                        help="each side's costliest GPU kernels over one more step")
    parser.add_argument("--attention-backward", choices=BACKWARD_VARIANTS,
                        help="the trainer's sparse attention backward in the row cases "
                        "(default: the kernels' own)")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attention_only:
        print(json.dumps(attention_only(args.seq, args.backward.split(","))))
        return
    if args.side:
        print(json.dumps(run_side(args.side, args.seq, args.moe_layers, args.experts,
                                  args.steps, args.profile, args.attention_backward)))
        return
    results: dict[str, Any] = {"moe_layers": args.moe_layers, "experts": args.experts,
                               "steps": args.steps,
                               "attention_backward": args.attention_backward or "default"}
    for case in args.cases.split(","):
        seq = int(case.removeprefix("row"))
        entry = {}
        for side in args.sides.split(","):
            entry[side] = _subprocess(["--side", side, "--seq", str(seq), "--moe-layers",
                                       str(args.moe_layers), "--experts", str(args.experts),
                                       "--steps", str(args.steps),
                                       *(["--profile"] if args.profile else []),
                                       *(["--attention-backward", args.attention_backward]
                                         if args.attention_backward else [])],
                                      args.timeout_s)
            print(case, side, json.dumps(entry[side]), flush=True)
        mine, theirs = entry.get("trainer", {}), entry.get("hf", {})
        if "tokens_per_s" in mine and "tokens_per_s" in theirs:
            entry["trainer_over_hf"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 3)
        results[case] = entry
    print(json.dumps(results))


if __name__ == "__main__":
    main()
