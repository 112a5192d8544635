"""The disk-streamed optimizer equals the in-memory one and torch's Adam/AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.optim.optimizer_stream import MasterAdam, plan_buckets


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 33), torch.nn.LayerNorm(33)
    )
    return model.to(dtype)


def _grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _run(model: torch.nn.Module, opt: object, steps: int) -> None:
    for step in range(steps):
        _grads(model, step)
        opt.step()  # type: ignore[attr-defined]


def test_plan_buckets_splits_params_across_buckets() -> None:
    params = [torch.zeros(10), torch.zeros(3), torch.zeros(9)]
    buckets = plan_buckets(params, 8)
    assert [b.numel for b in buckets] == [8, 8, 6]
    assert [(s.param_index, s.start, s.numel, s.offset) for s in buckets[1].slices] == [
        (0, 8, 2, 0), (1, 0, 3, 2), (2, 0, 3, 5)
    ]  # fmt: skip


@pytest.mark.parametrize("decoupled", [True, False])
def test_fp32_matches_torch_adam_bit_for_bit(tmp_path: Path, decoupled: bool) -> None:
    ref, mem, disk = _model(torch.float32), _model(torch.float32), _model(torch.float32)
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref_opt = torch_cls(ref.parameters(), foreach=False, **kwargs)
    tiny_mb = 200 * 4 / 2**20  # 200-element buckets: params straddle bucket boundaries
    mem_opt = MasterAdam(list(mem.parameters()), decoupled_weight_decay=decoupled, **kwargs)
    disk_opt = MasterAdam(
        list(disk.parameters()), decoupled_weight_decay=decoupled, state_dir=tmp_path,
        bucket_mb=tiny_mb, **kwargs,
    )  # fmt: skip
    assert len(disk_opt.buckets) > 3
    for model, opt in ((ref, ref_opt), (mem, mem_opt), (disk, disk_opt)):
        _run(model, opt, 5)
    for a, b, c in zip(ref.parameters(), mem.parameters(), disk.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    state = ref_opt.state[ref[1].weight]
    # fp32 parameters are their own master weights: the buckets hold the moments alone.
    numel = sum(p.numel() for p in disk.parameters())
    assert disk_opt.master_in_params and mem_opt.master_in_params
    assert disk_opt.state_nbytes() == mem_opt.state_nbytes() == 2 * 4 * numel
    disk_master, m, v = disk_opt._views(disk_opt.buckets[0], _read_bucket(tmp_path, 0))
    first = ref[0].weight.numel()
    assert first > 200 and disk_master is None
    assert torch.equal(m, ref_opt.state[ref[0].weight]["exp_avg"].view(-1)[:200])
    assert torch.equal(v, ref_opt.state[ref[0].weight]["exp_avg_sq"].view(-1)[:200])
    assert state["step"].item() == 5


def _read_bucket(directory: Path, index: int) -> torch.Tensor:
    return torch.frombuffer(
        bytearray((directory / f"bucket_{index:05d}.bin").read_bytes()), dtype=torch.uint8
    )


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_bf16_params_disk_equals_memory(tmp_path: Path, moments: torch.dtype) -> None:
    mem, disk = _model(torch.bfloat16), _model(torch.bfloat16)
    kwargs = {"lr": 1e-2, "weight_decay": 0.01, "moments_dtype": moments}
    mem_opt = MasterAdam(list(mem.parameters()), **kwargs)
    disk_opt = MasterAdam(list(disk.parameters()), state_dir=tmp_path, bucket_mb=1e-3, **kwargs)
    _run(mem, mem_opt, 4)
    _run(disk, disk_opt, 4)
    for a, b in zip(mem.parameters(), disk.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_bf16_params_follow_fp32_master_of_torch_adamw(tmp_path: Path) -> None:
    """bf16 model params are the rounded fp32 masters of a torch AdamW run on bf16 grads."""
    model = _model(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01, foreach=False)
    opt = MasterAdam(
        list(model.parameters()), lr=1e-2, weight_decay=0.01, state_dir=tmp_path, bucket_mb=1e-3
    )
    for step in range(4):
        _grads(model, step)
        for master, p in zip(masters, model.parameters(), strict=True):
            master.grad = p.grad.float()
        ref_opt.step()
        opt.step()
    for master, p in zip(masters, model.parameters(), strict=True):
        assert torch.equal(master.detach().to(torch.bfloat16), p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_and_load_resume_identically(tmp_path: Path, dtype: torch.dtype) -> None:
    """As the policy's checkpoint does: the model's state, then the optimizer's (bf16
    parameters are restored from the fp32 master; fp32 ones are their own master)."""
    a, b = _model(dtype), _model(dtype)
    opt_a = MasterAdam(list(a.parameters()), lr=1e-2, state_dir=tmp_path / "a", bucket_mb=1e-3)
    assert opt_a.master_in_params == (dtype == torch.float32)
    _run(a, opt_a, 2)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    opt_a.save(ckpt)
    model_state = {k: v.clone() for k, v in a.state_dict().items()}
    opt_b = MasterAdam(list(b.parameters()), lr=1e-2, state_dir=tmp_path / "b", bucket_mb=1e-3)
    b.load_state_dict(model_state)
    opt_b.load(ckpt)
    _assert_same_steps_on((a, opt_a), (b, opt_b), steps=range(2, 4))
    wrong = MasterAdam(list(b.parameters()), state_dir=tmp_path / "c", bucket_mb=2e-3)
    with pytest.raises(ValueError, match="layout"):
        wrong.load(ckpt)


@pytest.mark.parametrize("on_disk", [False, True])
def test_state_saved_with_a_master_copy_resumes_fp32_parameters(tmp_path: Path,
                                                                 on_disk: bool) -> None:
    """A checkpoint whose buckets hold the master (written by the whole-bucket path, or by
    fp32 runs before their parameters were their own master) resumes identically: the copy
    goes into the parameters, whatever the model's own state said."""
    a, b = _model(torch.float32), _model(torch.float32)
    opt_a = MasterAdam(list(a.parameters()), lr=1e-2, bucket_mb=1e-3, fused=True)
    assert not opt_a.master_in_params
    _run(a, opt_a, 2)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    opt_a.save(ckpt)
    opt_b = MasterAdam(list(b.parameters()), lr=1e-2, bucket_mb=1e-3,
                       state_dir=tmp_path / "b" if on_disk else None)
    assert opt_b.master_in_params
    opt_b.load(ckpt)  # b's parameters are still the initial ones: the master restores them
    _assert_same_steps_on((a, opt_a), (b, opt_b), steps=range(2, 4))
    bf16 = MasterAdam(list(_model(torch.bfloat16).parameters()), bucket_mb=1e-3)
    with pytest.raises(ValueError, match="parameter dtype"):  # no master for bf16 ones
        bf16.load(_saved(opt_b, tmp_path / "aliased"))


def _assert_same_steps_on(first: tuple[torch.nn.Module, MasterAdam],
                          second: tuple[torch.nn.Module, MasterAdam], steps: range) -> None:
    for step in steps:
        for model, opt in (first, second):
            _grads(model, step)
            opt.step()
    for x, y in zip(first[0].parameters(), second[0].parameters(), strict=True):
        assert torch.equal(x, y)


def _saved(opt: MasterAdam, directory: Path) -> Path:
    directory.mkdir()
    opt.save(directory)
    return directory


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_device_resident_whole_bucket_update_equals_per_slice_step_for_step(
    tmp_path: Path, moments: torch.dtype
) -> None:
    """The device-resident optimizer's whole-bucket update (its path on a GPU) takes the same
    steps as the per-slice one of host-resident state, also streamed from disk through it."""
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "moments_dtype": moments,
              "bucket_mb": 200 * 4 / 2**20}  # fmt: skip
    host, fused, streamed = _model(torch.bfloat16), _model(torch.bfloat16), _model(torch.bfloat16)
    host_opt = MasterAdam(list(host.parameters()), device=torch.device("cpu"), fused=False,
                          **kwargs)  # type: ignore[arg-type]
    fused_opt = MasterAdam(list(fused.parameters()), fused=True, **kwargs)  # type: ignore[arg-type]
    streamed_opt = MasterAdam(list(streamed.parameters()), fused=True, state_dir=tmp_path,
                              **kwargs)  # type: ignore[arg-type]
    assert fused_opt.fused and len(fused_opt.buckets) > 3
    for step in range(4):
        for model in (host, fused, streamed):
            _grads(model, step)
        if step == 2:  # a parameter without a gradient takes the per-slice path there
            for model in (host, fused, streamed):
                model[2].bias.grad = None
        for opt in (host_opt, fused_opt, streamed_opt):
            opt.step()
        for a, b, c in zip(host.parameters(), fused.parameters(), streamed.parameters(),
                           strict=True):  # fmt: skip
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            torch.testing.assert_close(c, a, rtol=0, atol=0)
    # the control: a step the others did not take moves the parameters
    _grads(host, 9)
    host_opt.step()
    assert not torch.equal(host[1].weight, fused[1].weight)
