"""The scheduler of one dp rank: a waiting queue, a running batch, and its prefix cache.

Each `step` admits waiting requests (prefill, reusing the longest cached prefix), then decodes
every running request together in one forward. Finished requests leave the batch and leave
their KV in the radix cache. The engine loop calls `step` and the pause/abort hooks, always
from its one thread.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import torch

from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner
from services.engine.radix_cache import RadixCache, common_prefix_len
from services.engine.request import GenRequest
from services.engine.running_batch import make_running_batch
from services.engine.sampling import biased, sample_tokens, scaled_logprobs, top_logprobs
from services.engine.stopping import check_stop

MIN_SHARED_PREFIX = 16  # uncached tokens two prompts must share for one to wait for the other


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
        self.batch = make_running_batch(runner, config)
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
        picked = self._pick()
        if not picked:
            return False
        try:
            prefilled = self._prefill(picked)
        except BaseException:  # back in the queue, where the engine's abort finds them
            self.waiting.extendleft(reversed(picked))
            raise
        rows = []
        for req, (pending, length) in zip(picked, prefilled, strict=True):
            if req.finished:
                self._finish(req, self.batch.pending_row(pending), length)
                self.batch.discard(pending)
                continue
            rows.append(pending)
            self.running.append(req)
        if rows:
            self.batch.add_rows(rows)
        return True

    def _pick(self) -> list[GenRequest]:
        """The waiting requests to prefill together now, within the slot and token budgets.

        A request that shares an uncached prefix with one already picked waits one step: the
        first one's prefill puts the prefix into the cache, and the rest reuse it."""
        picked: list[GenRequest] = []
        budget = self.config.max_total_num_tokens - self.num_used_tokens
        deferred = []
        while self.waiting and len(self.running) + len(picked) < self.config.max_running_requests:
            req = self.waiting[0]
            need = len(req.all_ids) + 1
            if (self.running or picked) and need > budget:
                break
            self.waiting.popleft()
            if picked and self._shares_uncached_prefix(req, picked):
                deferred.append(req)
                continue
            picked.append(req)
            budget -= need
        self.waiting.extendleft(reversed(deferred))
        return picked

    def _shares_uncached_prefix(self, req: GenRequest, picked: list[GenRequest]) -> bool:
        tokens = req.all_ids[:-1]
        shared = max(common_prefix_len(tokens, other.all_ids) for other in picked)
        return shared >= MIN_SHARED_PREFIX and shared > self.cache.match_len(tokens)

    def _prefill(self, reqs: list[GenRequest]) -> list[tuple[Any, int]]:
        """Compute the requests' prompt KV into pending rows and sample their first tokens."""
        jobs = []
        for req in reqs:
            tokens = req.all_ids
            input_logprobs = (req.return_logprob and req.logprob_start_len >= 0
                              and not req.prefilled)
            prefix_len, prefix = 0, None
            if not input_logprobs:
                # Positions whose routes are asked for and not yet recorded must be forwarded.
                end = min(len(tokens) - 1, req.routed_until) if req.return_routed_experts else -1
                prefix_len, prefix = self.cache.match_prefix(tokens[:end])
            jobs.append((tokens, prefix, input_logprobs, prefix_len))
        results = self.batch.prefill([(tokens, prefix, every) for tokens, prefix, every, _ in jobs])
        if self.runner.routed_experts is not None:  # one forward per job (padded batch)
            for req, job, routes in zip(reqs, jobs, self.runner.routed_experts.take_all(),
                                        strict=True):
                req.add_routes(job[3], routes)
        try:
            self._first_tokens(reqs, jobs, results)
        except BaseException:  # the rows never join: give their KV back before the error rises
            for _, pending in results:
                self.batch.discard(pending)
            raise
        return [(pending, len(job[0])) for (_, pending), job in zip(results, jobs, strict=True)]

    def _first_tokens(self, reqs: list[GenRequest], jobs: list[Any], results: list[Any]
                      ) -> None:
        """Prefill bookkeeping per request (metrics, input log-probs, prefix cache), then the
        first output token of each, sampled together."""
        sampled = []
        for req, (tokens, _, input_logprobs, prefix_len), (logits, pending) in zip(
            reqs, jobs, results, strict=True
        ):
            self._record_prefill(req, prefix_len)
            if input_logprobs:
                self._input_logprobs(req, tokens, logits)
            self.cache.insert(tokens, self.batch.pending_row(pending))
            if req.params.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
            else:
                sampled.append((req, logits[-1:]))
        if sampled:
            reqs_out = [req for req, _ in sampled]
            last = torch.cat([logits for _, logits in sampled])
            tokens_out, logprobs = sample_tokens(
                last, [r.params for r in reqs_out], [r.generator for r in reqs_out]
            )
            tops = self._top_logprobs(last, reqs_out)
            for req, token, logprob, top in zip(
                reqs_out, tokens_out.tolist(), logprobs.tolist(), tops, strict=True
            ):
                self._append(req, token, logprob, top)

    def _record_prefill(self, req: GenRequest, prefix_len: int) -> None:
        if req.prefilled:
            return
        req.prefilled = True
        req.cached_tokens = prefix_len
        self.metrics.observe("queue_time", time.perf_counter() - req.created_at)
        self.metrics.count("prompt_tokens", len(req.input_ids))
        self.metrics.count("cached_tokens", prefix_len)
        self.metrics.set_rank(self.dp_rank, cache_hit_rate=prefix_len / max(1, len(req.input_ids)))

    @staticmethod
    def _input_logprobs(req: GenRequest, tokens: list[int], logits: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits.float()[:-1], dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens[1:])[:, None].to(logits.device))
        values: list[float | None] = [None, *chosen.squeeze(1).tolist()]
        req.input_logprobs = values[req.logprob_start_len :]
        if req.top_logprobs_num:
            tops: list[list[tuple[float, int]] | None] = [None]
            tops += top_logprobs(logprobs, req.top_logprobs_num)
            req.input_top_logprobs = tops[req.logprob_start_len :]

    def _decode(self) -> None:
        last = [(req.output_ids or req.input_ids)[-1] for req in self.running]
        logits = self.batch.decode(last)
        if self.runner.routed_experts is not None:
            (routes,) = self.runner.routed_experts.take_all()
            for i, req in enumerate(self.running):
                req.add_routes(len(req.all_ids) - 1, routes[i : i + 1])
        tokens, logprobs = sample_tokens(
            logits, [r.params for r in self.running], [r.generator for r in self.running]
        )
        tops = self._top_logprobs(logits, self.running)
        now = time.perf_counter()
        intervals: Counter[float] = Counter()  # rows of one step mostly share their interval
        for req, token, logprob, top in zip(
            self.running, tokens.tolist(), logprobs.tolist(), tops, strict=True
        ):
            if req.last_token_at is not None:
                intervals[now - req.last_token_at] += 1
            self._append(req, token, logprob, top, now)
        for interval, count in intervals.items():
            self.metrics.observe("itl", interval, count)
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
                top: list[tuple[float, int]] | None = None, now: float | None = None) -> None:
        """Add one output token to `req` (decode observes the inter-token latency in bulk)."""
        if now is None:
            now = time.perf_counter()
            if req.last_token_at is not None:
                self.metrics.observe("itl", now - req.last_token_at)
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.observe("ttft", now - req.created_at)
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
