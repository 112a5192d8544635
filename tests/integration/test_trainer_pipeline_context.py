"""Pipeline x context parallelism with uneven stages on four gloo ranks against one rank.

A three-layer Qwen2 (GQA, tied embeddings) splits as [1, 2] layers over PP=2 stages, each
stage over CP=2 ranks: rows whose length is no multiple of 2*CP get Hugging Face's log-probs
through the forward-only pipeline, the exported Hugging Face tensors equal the loaded ones
exactly (each layer found on its stage), and two training steps (micro-batches of different
shapes, two minibatches, a KL term to a pipelined reference) end with the tensors and
metrics of a one-rank trainer fed the same batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks

STAGES = [1, 2]


def _batches() -> list[Any]:
    import torch

    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
    from services.trainer.data.batch import pack_groups

    batches = []
    for step in range(2):
        entries = []
        for g in range(2):
            gen = torch.Generator().manual_seed(10 * step + g)
            samples = []
            for i in range(3):
                n = 4 + 3 * i + g
                samples.append(Trajectory(
                    sample_id=f"s{step}-{g}-{i}", prompt_ids=[1, 2, 3 + g],
                    response_ids=torch.randint(3, 96, (n,), generator=gen).tolist(),
                    loss_mask=[1] * (n - 1) + [0], rollout_logprobs=[-3.0 - 0.1 * i] * n,
                    reward=float(i == (step + g) % 3), status=VERDICT_STATUS_SCORED,
                ))  # fmt: skip
            entries.append((f"e{step}-{g}", Group(group_id=f"g{step}-{g}", samples=samples)))
        batches.append(pack_groups(entries, True, 24))
    return batches


def _train(rank: int, world_size: int, master_port: int, model_path: str,
           parallel: dict[str, Any]) -> Any:
    """Build the policy on this rank and train the batches; returns (built, metrics, train)."""
    from services.trainer.config import TrainerConfig
    from services.trainer.megatron_policy import RankAddress, build_policy
    from services.trainer.pipeline_step import train_step_for

    config = TrainerConfig.model_validate({
        "num_minibatches": 2,
        "max_tokens_per_microbatch": 24,
        "loss": {"kl_coef": 0.1},
        "model": {"hf_path": model_path, "dtype": "float32"},
        "optimizer": {"lr": 1e-3, "eps": 1e-6, "max_grad_norm": 0.5},
        "parallel": parallel,
        "weight_sync": {"mode": "off"},
    })  # fmt: skip
    built = build_policy(config, RankAddress(rank, world_size, "127.0.0.1", master_port))
    return built, config, train_step_for(config.parallel)


def pipeline_context_worker(
    rank: int, world_size: int, master_port: int, model_path: str
) -> dict[str, Any]:
    """PP=2 x CP=2 on [1, 2] layers over all ranks, then (rank 0) one rank."""
    import torch

    from services.common.ports import free_port
    from services.trainer.objective.logprobs import pipelined_token_logprobs, token_logprobs
    from services.trainer.parallel.parallel import teardown_parallel
    from services.trainer.weights.convert import SafetensorsFolder, iter_hf_tensors

    out: dict[str, Any] = {}
    parallel = {"pipeline_parallel": 2, "context_parallel": 2, "num_layers_per_stage": STAGES}
    built, config, train = _train(rank, world_size, master_port, model_path, parallel)
    out["layers"] = [layer.layer_number for layer in built.model.decoder.layers]
    loaded = dict(SafetensorsFolder(model_path))
    exported = dict(iter_hf_tensors(built.model, built.shape))
    out["round_trip"] = sorted(n for n in loaded | exported
                               if n not in loaded or n not in exported
                               or not torch.equal(loaded[n], exported[n]))  # fmt: skip
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    logprobs = pipelined_token_logprobs(built.model, ids)
    out["logprobs"] = None if logprobs is None else logprobs.tolist()
    batches = _batches()
    out["metrics"] = [train(built.policy, batch, config.loss.settings(), config.num_minibatches,
                            built.reference, built.shard) for batch in batches]  # fmt: skip
    tensors = dict(iter_hf_tensors(built.model, built.shape))
    teardown_parallel()
    if rank != 0:
        return out
    one, config, train = _train(0, 1, free_port(), model_path, {})
    out["one_logprobs"] = token_logprobs(one.model, ids).detach().tolist()
    out["one_metrics"] = [train(one.policy, batch, config.loss.settings(),
                                config.num_minibatches, one.reference, one.shard)
                          for batch in batches]  # fmt: skip
    one_tensors = dict(iter_hf_tensors(one.model, one.shape))
    teardown_parallel()
    assert tensors.keys() == one_tensors.keys()
    out["diffs"] = {k: float((tensors[k] - one_tensors[k]).abs().max()) for k in one_tensors}
    out["moved"] = max(float((one_tensors[k] - loaded[k]).abs().max()) for k in one_tensors)
    out["hf_logprobs"] = _hf_logprobs(model_path, ids).tolist()
    return out


def _hf_logprobs(model_path: str, ids: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from services.testing.hf_models import reference_logprobs

    hf = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()
    return reference_logprobs(hf, ids)


@pytest.mark.slow
def test_pp2_cp2_uneven_stages_train_like_one_rank(tmp_path: Path) -> None:
    import torch

    from services.testing.hf_models import random_hf_model

    model_path = tmp_path / "qwen2"
    random_hf_model("qwen2", num_layers=3, tie_word_embeddings=True).save_pretrained(model_path)
    results = run_ranks(Path(__file__), "pipeline_context_worker", 4,
                        {"model_path": str(model_path)})  # fmt: skip
    first = results[0]
    hf = torch.tensor(first["hf_logprobs"])
    for rank, r in enumerate(results):  # ranks 0, 1: first stage; 2, 3: last stage
        assert r["layers"] == ([1] if rank < 2 else [2, 3]), (rank, r["layers"])
        assert r["round_trip"] == [], (rank, r["round_trip"])
        if rank >= 2:
            assert float((torch.tensor(r["logprobs"]) - hf).abs().max()) < 1e-5, rank
        assert r["metrics"] == results[0]["metrics"]
    assert float((torch.tensor(first["one_logprobs"]) - hf).abs().max()) < 1e-5
    worst = max(first["diffs"], key=first["diffs"].__getitem__)
    print("max |pp2 x cp2 - one rank| =", first["diffs"][worst], "at", worst,
          "; moved from initial", first["moved"])
    assert "lm_head.weight" not in first["diffs"]
    assert first["moved"] > 1e-3
    assert first["diffs"][worst] < 2e-5, first["diffs"]  # Adam magnifies fp32 noise
    for ours, one in zip(first["metrics"], first["one_metrics"], strict=True):
        assert ours.keys() == one.keys()
        for key, value in one.items():
            assert abs(ours[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, ours, one)


def mla_stages_worker(rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    """GLM-5's path (MLA, DSA indexers, an MTP layer carried) on [2, 1] layers at PP=2 (a
    stage starts at a layer that computes its DSA top-k: layers 0 and 2 here)."""
    import torch

    from services.testing.hf_models import random_hf_model, reference_logprobs
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import pipelined_token_logprobs
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights import weight_map
    from services.trainer.weights.convert import iter_hf_tensors, load_hf_weights
    from services.trainer.weights.weight_map_mla import MTP_PREFIX, carried_rules

    init_parallel(ParallelConfig(pipeline_parallel=2), rank=rank, world_size=world_size,
                  master_port=master_port)  # fmt: skip
    hf = random_hf_model("glm_moe_dsa", num_layers=3, num_kv_heads=4, num_nextn_predict_layers=1,
                         index_topk=6, index_n_heads=8)  # fmt: skip
    shape = ModelShape.from_hf(hf.config)
    original = weight_map.checkpoint_state(shape, hf.state_dict())
    gen = torch.Generator().manual_seed(7)
    for rule in carried_rules(shape):  # type: ignore[arg-type]
        if rule.mcore.startswith(MTP_PREFIX):  # transformers does not build the MTP layer
            full = torch.randn(rule.full_shape, generator=gen)
            original.update(zip(rule.hf, weight_map.unfuse(rule, shape, full), strict=True))
    model = build_gpt_model(shape, num_layers_per_stage=[2, 1])
    load_hf_weights(model, shape, original)
    back = dict(iter_hf_tensors(model, shape))
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(5))
    ours = pipelined_token_logprobs(model, ids)
    result = {
        "layers": [layer.layer_number for layer in model.decoder.layers],
        "round_trip": sorted(n for n in original | back if n not in original or n not in back
                             or not torch.equal(back[n], original[n])),  # fmt: skip
        "logprob_diff": None if ours is None
        else float((ours - reference_logprobs(hf, ids)).abs().max()),
    }
    teardown_parallel()
    return result


@pytest.mark.slow
def test_mla_uneven_stages_round_trip_and_match_hf() -> None:
    first, last = run_ranks(Path(__file__), "mla_stages_worker", 2)
    assert (first["layers"], last["layers"]) == ([1, 2], [3])
    assert first["round_trip"] == last["round_trip"] == []
    assert first["logprob_diff"] is None
    assert last["logprob_diff"] < 1e-5
