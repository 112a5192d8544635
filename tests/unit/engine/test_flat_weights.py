"""The engine's parameters as views of one buffer per dtype, in checkpoint order."""

from __future__ import annotations

import torch

from services.common.tensor_layout import ALIGN_BYTES
from services.engine.flat_weights import FlatWeights
from services.testing.hf_models import random_hf_model


def _views(flat: FlatWeights) -> list[tuple[int, int]]:
    """(start, end) of each parameter, in bytes from its buffer's start."""
    spans = []
    for slot in flat.slots:
        base = flat.buffers[slot.dtype].data_ptr()
        start = slot.param.data_ptr() - base
        spans.append((start, start + slot.param.numel() * slot.param.element_size()))
    return spans


def test_parameters_become_back_to_back_views_in_state_dict_order_with_their_values() -> None:
    model = random_hf_model("llama", tie_word_embeddings=True)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flat = FlatWeights(model, torch.device("cpu"))
    assert len(flat.buffers) == 1
    # the tied output embedding is the input embedding's parameter: laid out once
    names = list(model.state_dict())
    assert len(flat.slots) == len(names) - 1
    spans = _views(flat)
    assert spans[0][0] == 0 and spans[-1][1] == flat.num_bytes
    base = flat.buffers[torch.float32].data_ptr()
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start % ALIGN_BYTES == 0 and end <= start < end + ALIGN_BYTES
        # padding, and only padding, is listed as a gap a copy may overwrite
        assert flat.gaps.get(base + end) == (base + start if start != end else None)
    assert len(flat.gaps) == sum(1 for a, b in zip(spans, spans[1:], strict=False) if a[1] != b[0])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_a_size_off_the_boundary_pads_the_next_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 1, bias=True), torch.nn.Linear(1, 4))
    flat = FlatWeights(model, torch.device("cpu"))  # float32: 64 elements to 256 bytes
    starts = [start for start, _ in _views(flat)]
    # weight 64 (256 bytes: the bias follows at once); bias 1, weight 4: each padded
    assert starts == [0, 256, 512, 768]
    assert flat.num_bytes == 768 + 4 * 4
    base = flat.buffers[torch.float32].data_ptr()
    assert flat.gaps == {base + 260: base + 512, base + 528: base + 768}


def test_release_frees_the_buffers_and_resume_points_the_parameters_back() -> None:
    model = random_hf_model("qwen2")
    flat = FlatWeights(model, torch.device("cpu"))
    spans, size = _views(flat), flat.num_bytes
    flat.release()
    assert not flat.buffers
    assert all(p.numel() == 0 for p in model.parameters())
    flat.resume()
    assert flat.num_bytes == size and _views(flat) == spans
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(s.shape) for s in flat.slots]
    flat.resume()  # resuming what is resident changes nothing
    assert _views(flat) == spans


def test_without_the_flat_layout_each_parameter_keeps_its_own_allocation() -> None:
    model = random_hf_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flat = FlatWeights(model, torch.device("cpu"), flat=False)
    assert not flat.buffers and flat.resident
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    flat.resume()  # resident: nothing moves, nothing is lost
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    flat.release()
    assert all(p.numel() == 0 for p in model.parameters())
    flat.resume()
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(s.shape) for s in flat.slots]
