"""The scheduler of one dp rank: a waiting queue, a running batch, and its prefix cache.

Each `step` admits waiting requests (prefill, reusing the longest cached prefix), then decodes
every running request together in one forward. Finished requests leave the batch and leave
their KV in the radix cache. The engine loop calls `step` and the pause/abort hooks, always
from its one thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from services.engine.batch_kv import BatchKV, cache_layers
from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner
from services.engine.radix_cache import RadixCache
from services.engine.request import GenRequest
from services.engine.sampling import biased, sample_tokens, scaled_logprobs, top_logprobs
from services.engine.stopping import check_stop


class Scheduler:
    """Continuous batching for one dp rank."""

    def __init__(
        self,
        dp_rank: int,
        runner: ModelRunner,
        config: EngineConfig,
        metrics: EngineMetrics,
        weight_version: list[str],
    ) -> None:
        self.dp_rank = dp_rank
        self.runner = runner
        self.config = config
        self.metrics = metrics
        self._weight_version = weight_version  # shared one-item list, updated by the engine
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.batch = BatchKV()
        self.cache = RadixCache(config.prefix_cache_num_tokens)
        self.num_generated = 0

    @property
    def num_used_tokens(self) -> int:
        return sum(self.batch.lengths)

    def load(self) -> dict[str, Any]:
        return {
            "dp_rank": self.dp_rank,
            "num_reqs": len(self.running) + len(self.waiting),
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": self.num_used_tokens,
        }

    def step(self, admit: bool = True) -> bool:
        """Admit what fits, then decode one token for every running request; True if busy."""
        admitted = self._admit() if admit else False
        if self.running:
            self._decode()
        return admitted or bool(self.running)

    def _admit(self) -> bool:
        rows = []
        budget = self.config.max_total_num_tokens - self.num_used_tokens
        while self.waiting and len(self.running) < self.config.max_running_requests:
            need = len(self.waiting[0].all_ids) + 1
            if self.running and need > budget:
                break
            req = self.waiting.popleft()
            cache, length = self._prefill(req)
            if req.finished:
                self._finish(req, [(k[0], v[0]) for k, v in cache_layers(cache)], length)
                continue
            budget -= length + 1
            rows.append((cache, length))
            self.running.append(req)
        if rows:
            self.batch.add_rows(rows)
        return bool(rows)

    def _prefill(self, req: GenRequest) -> tuple[Any, int]:
        tokens = req.all_ids
        input_logprobs = req.return_logprob and req.logprob_start_len >= 0 and not req.prefilled
        prefix_len, prefix = 0, None
        if not input_logprobs:
            # Positions whose routes are asked for and not yet recorded must be forwarded.
            end = min(len(tokens) - 1, req.routed_until) if req.return_routed_experts else -1
            prefix_len, prefix = self.cache.match_prefix(tokens[:end])
        logits, cache = self.runner.prefill(tokens, prefix, all_logits=input_logprobs)
        if self.runner.routed_experts is not None:
            req.add_routes(prefix_len, self.runner.routed_experts.take())
        if not req.prefilled:
            req.prefilled = True
            req.cached_tokens = prefix_len
            self.metrics.observe("queue_time", time.perf_counter() - req.created_at)
            self.metrics.count("prompt_tokens", len(req.input_ids))
            self.metrics.count("cached_tokens", prefix_len)
            self.metrics.set_rank(
                self.dp_rank, cache_hit_rate=prefix_len / max(1, len(req.input_ids))
            )
        if input_logprobs:
            logprobs = torch.log_softmax(logits.float()[:-1], dim=-1)
            chosen = logprobs.gather(1, torch.tensor(tokens[1:])[:, None].to(logits.device))
            values: list[float | None] = [None, *chosen.squeeze(1).tolist()]
            req.input_logprobs = values[req.logprob_start_len :]
            if req.top_logprobs_num:
                tops: list[list[tuple[float, int]] | None] = [None]
                tops += top_logprobs(logprobs, req.top_logprobs_num)
                req.input_top_logprobs = tops[req.logprob_start_len :]
        row = [(k[0], v[0]) for k, v in cache_layers(cache)]
        self.cache.insert(tokens, row)
        if req.params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
        else:
            token, logprob = sample_tokens(logits[-1:], [req.params], [req.generator])
            tops = self._top_logprobs(logits[-1:], [req])
            self._append(req, int(token[0]), float(logprob[0]), tops[0])
        return cache, len(tokens)

    def _decode(self) -> None:
        last = [req.all_ids[-1] for req in self.running]
        logits = self.runner.decode(last, self.batch)
        if self.runner.routed_experts is not None:
            routes = self.runner.routed_experts.take()
            for i, req in enumerate(self.running):
                req.add_routes(len(req.all_ids) - 1, routes[i : i + 1])
        tokens, logprobs = sample_tokens(
            logits, [r.params for r in self.running], [r.generator for r in self.running]
        )
        tops = self._top_logprobs(logits, self.running)
        for req, token, logprob, top in zip(
            self.running, tokens.tolist(), logprobs.tolist(), tops, strict=True
        ):
            self._append(req, token, logprob, top)
        self._release([i for i, req in enumerate(self.running) if req.finished])

    @staticmethod
    def _top_logprobs(
        logits: torch.Tensor, reqs: list[GenRequest]
    ) -> list[list[tuple[float, int]] | None]:
        """Each request's `top_logprobs_num` likeliest next tokens (None where not asked)."""
        k = max(r.top_logprobs_num for r in reqs)
        if not k:
            return [None] * len(reqs)
        params = [r.params for r in reqs]
        tops = top_logprobs(scaled_logprobs(biased(logits.float(), params), params), k)
        return [top[: r.top_logprobs_num] if r.top_logprobs_num else None
                for r, top in zip(reqs, tops, strict=True)]

    def _append(self, req: GenRequest, token: int, logprob: float,
                top: list[tuple[float, int]] | None = None) -> None:
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.observe("ttft", now - req.created_at)
        elif req.last_token_at is not None:
            self.metrics.observe("itl", now - req.last_token_at)
        req.last_token_at = now
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        req.record_version(self._weight_version[0])
        if top is not None:
            req.output_top_logprobs.append(top)
        self.num_generated += 1
        self.metrics.count("generation_tokens")
        req.finish_reason = check_stop(req, self.runner)
        if not req.finished and req.stream:
            req.emit(req.snapshot(self._weight_version[0]))

    def _release(self, indices: list[int]) -> None:
        """Finish the running requests at `indices` (already marked) and drop their rows."""
        if not indices:
            return
        gone = set(indices)
        for i in indices:
            self._finish(self.running[i], self.batch.row(i), self.batch.lengths[i])
        keep = [i for i in range(len(self.running)) if i not in gone]
        self.running = [self.running[i] for i in keep]
        self.batch.keep_rows(keep)

    def _finish(self, req: GenRequest, row: Any, length: int) -> None:
        self.cache.insert(req.all_ids[:length], row)
        self._complete(req)

    def _complete(self, req: GenRequest) -> None:
        self.metrics.count("num_requests")
        if req.finish_reason and req.finish_reason["type"] == "abort":
            self.metrics.count("num_aborted_requests")
        self.metrics.observe("e2e", time.perf_counter() - req.created_at)
        req.emit(req.snapshot(self._weight_version[0]))

    def abort(self, hit: Callable[[GenRequest], bool], message: str) -> int:
        """Finish the requests `hit` selects as aborted; returns how many."""
        reason = {"type": "abort", "message": message}
        queued = [req for req in self.waiting if hit(req)]
        self.waiting = deque(req for req in self.waiting if not hit(req))
        for req in queued:
            req.finish_reason = reason
            self._complete(req)
        indices = [i for i, req in enumerate(self.running) if hit(req)]
        for i in indices:
            self.running[i].finish_reason = reason
        self._release(indices)
        return len(queued) + len(indices)

    def retract(self) -> int:
        """Send every running request back to the front of the queue, dropping its KV."""
        retracted = self.running
        for req in retracted:
            req.num_retractions += 1
        self.metrics.count("num_retracted_requests", len(retracted))
        self.waiting.extendleft(reversed(retracted))
        self.running = []
        self.batch.keep_rows([])
        return len(retracted)

    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            return False
        self.cache.flush()
        return True
