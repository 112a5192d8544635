"""Next-token sampling for a batch: greedy, temperature, top-k and top-p, seeded per request.

Each request draws its uniform numbers from its own generator, so a seeded request samples the
same tokens whatever else shares its batch. Log-probs follow SGLang: the log-softmax of the
temperature-scaled logits (raw logits for greedy rows), before top-k/top-p filtering.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.random_stream import RandomStream
from services.engine.request import SamplingParams


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[RandomStream | torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, V]; returns (token ids [B], their log-probs [B])."""
    logits = biased(logits.float(), params)
    batch, vocab = logits.shape
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    logprobs = scaled_logprobs(logits, params)
    tokens = logits.argmax(dim=-1)
    rows = [i for i in range(batch) if not params[i].greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        uniforms = torch.tensor([_uniform(generators[i]) for i in rows])
        picked = sample_filtered(
            logprobs.index_select(0, index).exp(),
            top_k=[params[i].top_k for i in rows],
            top_p=[params[i].top_p for i in rows],
            uniforms=uniforms.to(logits.device),
        )
        tokens = tokens.index_copy(0, index, picked)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def _uniform(source: RandomStream | torch.Generator | None) -> float:
    if isinstance(source, RandomStream):
        return source.next_uniform()
    return float(torch.rand((), generator=source))


def biased(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` [B, V] plus each row's `logit_bias` (SGLang adds it before temperature)."""
    if not any(p.logit_bias for p in params):
        return logits
    logits = logits.clone()
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            logits[row, token] += bias
    return logits


def scaled_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Log-softmax of the temperature-scaled logits (raw logits for greedy rows) [B, V]."""
    temps = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params],
        device=logits.device,
        dtype=logits.dtype,
    )
    return torch.log_softmax(logits / temps[:, None], dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """The `k` most likely tokens of each row of `logprobs` [B, V]: [(logprob, token id)]."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(),
                                                         strict=True)]


def sample_filtered(
    probs: torch.Tensor, *, top_k: Sequence[int], top_p: Sequence[float], uniforms: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sampling from `probs` [R, V] restricted to each row's top-k and top-p set."""
    rows, vocab = probs.shape
    if all(kk < 0 or kk >= vocab for kk in top_k) and all(pp >= 1.0 for pp in top_p):
        # Nothing to filter: invert the CDF in vocabulary order (no sort of the whole vocab).
        cdf = probs.cumsum(dim=-1)
        cdf = cdf / cdf[:, -1:]
        picked = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype), right=True)
        return picked.clamp(max=vocab - 1).squeeze(1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.tensor([vocab if kk < 0 else min(kk, vocab) for kk in top_k], device=probs.device)
    keep = ranks < k[:, None]
    p = torch.tensor(list(top_p), device=probs.device, dtype=probs.dtype)
    # Keep a token while the mass before it is below top_p; the first token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= (mass_before < p[:, None]) | (ranks == 0)
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = kept.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    position = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype), right=True)
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    position = torch.minimum(position, last_kept)
    return order.gather(1, position).squeeze(1)
