"""The running batch over KV slots: prefill writes a request's KV into its own slot, decode
runs every row in one step (a CUDA graph replay on GPU), rows leave by freeing their slot.

Implements `running_batch.RunningBatch` for the scheduler.
"""

from __future__ import annotations

import logging

import torch

from services.engine.decode_graphs import DecodeGraphs, width_bucket
from services.engine.model_runner import ModelRunner
from services.engine.prefill_graphs import ROW_BUCKETS, PrefillGraphs
from services.engine.radix_cache import KV, kv_len
from services.engine.slot_kv import SlotKV
from services.engine.slot_model import PrefillRow, SlotModel

log = logging.getLogger(__name__)


PrefillJob = tuple[list[int], KV | None, bool]  # tokens, cached prefix, all logits?
PIECE_TOKENS = 1024  # longest prompt piece in one forward
CHUNK_CELLS = 1 << 25  # most rows x tokens x width in one prefill forward (attention scores)


def _chunks(rows: list[tuple[int, PrefillRow]]) -> list[list[tuple[int, PrefillRow]]]:
    """Consecutive groups of rows whose padded attention stays within CHUNK_CELLS."""
    chunks: list[list[tuple[int, PrefillRow]]] = []
    tokens = width = 0
    for item in rows:
        row = item[1]
        n, w = max(tokens, len(row.tokens)), max(width, row.start + len(row.tokens))
        if chunks and (len(chunks[-1]) + 1) * n * w <= CHUNK_CELLS:
            chunks[-1].append(item)
            tokens, width = n, w
        else:
            chunks.append([item])
            tokens, width = len(row.tokens), row.start + len(row.tokens)
    return chunks


class SlotBatch:
    """Rows are (slot, length); lengths count the tokens whose KV the slot holds."""

    def __init__(self, runner: ModelRunner, num_slots: int, slot_len: int, cuda_graph: bool
                 ) -> None:
        config = runner.model.config
        attn = runner.model.model.layers[0].self_attn
        self.kv = SlotKV(
            num_layers=config.num_hidden_layers,
            num_slots=num_slots,
            slot_len=slot_len,
            kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim,
            dtype=runner.dtype,
            device=runner.device,
        )
        self.model = SlotModel(runner.model, self.kv)
        use_graphs = cuda_graph and runner.device.type == "cuda"
        self.graphs = DecodeGraphs(self.model, num_slots) if use_graphs else None
        self.prefill_graphs = PrefillGraphs(self.model, use_graphs=True) if use_graphs else None
        self.slots: list[int] = []
        self.lengths: list[int] = []
        log.info("KV slots: %d x %d tokens, %.2f GiB", num_slots, slot_len,
                 self.kv.num_bytes / 2**30)
        if self.graphs is not None:
            seconds = self.graphs.capture_all()
            log.info("captured %d decode CUDA graphs in %.1f s", self.graphs.num_graphs, seconds)

    @property
    def size(self) -> int:
        return len(self.slots)

    def free_memory(self) -> None:
        """Free the KV storage and the decode graphs (the batch must be empty)."""
        self.drop_graphs()
        self.kv.free_storage()

    def restore_memory(self) -> None:
        """Allocate the KV storage again (the graphs are captured by `capture_graphs`)."""
        if not self.kv.keys:
            self.kv.allocate_storage()

    def drop_graphs(self) -> None:
        """Forget the decode and prefill graphs: the weights they read are about to move."""
        if self.graphs is not None:
            self.graphs.reset()
        if self.prefill_graphs is not None:
            self.prefill_graphs.reset()

    def capture_graphs(self) -> float:
        """Capture every decode graph again; returns seconds (0 without graphs)."""
        return self.graphs.capture_all() if self.graphs is not None else 0.0

    def prefill(self, jobs: list[PrefillJob]) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """Forward each job's tokens (its first len(prefix) already computed) into a fresh
        slot: all jobs together, long prompts piece by piece; (logits, pending row) each."""
        slots: list[int] = []
        try:
            for _, prefix, _ in jobs:
                slots.append(self.kv.allocate())
                if prefix is not None:
                    self.kv.write(slots[-1], prefix)
            logits = self._prefill_pieces(jobs, slots)
        except BaseException:
            for slot in slots:
                self.kv.release(slot)
            raise
        return [(out, (slot, len(tokens)))
                for out, slot, (tokens, _, _) in zip(logits, slots, jobs, strict=True)]

    def _prefill_pieces(self, jobs: list[PrefillJob], slots: list[int]) -> list[torch.Tensor]:
        starts = [0 if prefix is None else kv_len(prefix) for _, prefix, _ in jobs]
        parts: list[list[torch.Tensor]] = [[] for _ in jobs]
        while True:
            rows = [(i, PrefillRow(slots[i], tokens[starts[i] : starts[i] + PIECE_TOKENS],
                                   starts[i], all_logits))
                    for i, (tokens, _, all_logits) in enumerate(jobs)
                    if starts[i] < len(tokens)]
            if not rows:
                return [torch.cat(p) for p in parts]
            for chunk in _chunks(rows):
                outs = self._prefill_rows([row for _, row in chunk])
                for (i, row), out in zip(chunk, outs, strict=True):
                    parts[i] = [*parts[i], out] if row.all_logits else [out]
                    starts[i] += len(row.tokens)

    def _prefill_rows(self, rows: list[PrefillRow]) -> list[torch.Tensor]:
        """One prefill of `rows`: those short enough for the graphs' buckets as replays (in
        groups of the largest row bucket), the rest in one eager forward."""
        graphs = self.prefill_graphs
        if graphs is None:
            return self.model.prefill(rows)
        outs: list[torch.Tensor | None] = [None] * len(rows)
        short = [i for i, row in enumerate(rows) if graphs.key([row]) is not None]
        rest = [i for i in range(len(rows)) if i not in set(short)]
        most = ROW_BUCKETS[-1]
        groups = [short[i : i + most] for i in range(0, len(short), most)]
        for group in groups:
            part = [rows[i] for i in group]
            key = graphs.key(part)
            if key is None:  # this group's bucket failed to capture before
                rest += group
                continue
            for i, out in zip(group, graphs.prefill(part, key), strict=True):
                outs[i] = out
        if rest:
            rest.sort()
            for i, out in zip(rest, self.model.prefill([rows[i] for i in rest]), strict=True):
                outs[i] = out
        done = [out for out in outs if out is not None]
        assert len(done) == len(rows), "every row is prefilled once"
        return done

    def pending_row(self, pending: tuple[int, int]) -> KV:
        return self.kv.row(*pending)

    def discard(self, pending: tuple[int, int]) -> None:
        self.kv.release(pending[0])

    def add_rows(self, pending: list[tuple[int, int]]) -> None:
        self.slots += [slot for slot, _ in pending]
        self.lengths += [length for _, length in pending]

    @torch.inference_mode()
    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        """One decode step for every row; returns logits [B, V]."""
        if self.graphs is not None:
            width = width_bucket(max(self.lengths) + 1, self.kv.slot_len)
            logits = self.graphs.run(last_tokens, self.lengths, self.slots, width)
        else:
            logits = self._eager_decode(last_tokens)
        self.lengths = [n + 1 for n in self.lengths]
        return logits

    def _eager_decode(self, last_tokens: list[int]) -> torch.Tensor:
        """The decode step without graphs: attention reads exactly the columns needed, and when
        the rows' slots are consecutive (the usual case: slots go lowest first) it reads them
        as one view, the rows taken in slot order, instead of gathering a copy per layer."""
        device = self.model.cos.device
        order = sorted(range(self.size), key=self.slots.__getitem__)
        low = self.slots[order[0]]
        consecutive = all(self.slots[i] == low + rank for rank, i in enumerate(order))
        if not consecutive:
            order = list(range(self.size))
        slots = [self.slots[i] for i in order]
        read: torch.Tensor | slice | None = slice(low, low + self.size) if consecutive else None
        logits = self.model.decode(
            torch.tensor([last_tokens[i] for i in order], device=device),
            torch.tensor([self.lengths[i] for i in order], device=device),
            torch.tensor(slots, device=device),
            max(self.lengths) + 1,
            read,
        )
        if order == sorted(order):
            return logits
        inverse = torch.empty(self.size, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(self.size)
        return logits.index_select(0, inverse.to(device))

    def row(self, index: int) -> KV:
        return self.kv.row(self.slots[index], self.lengths[index])

    def keep_rows(self, indices: list[int]) -> None:
        kept = set(indices)
        for index, slot in enumerate(self.slots):
            if index not in kept:
                self.kv.release(slot)
        self.slots = [self.slots[i] for i in indices]
        self.lengths = [self.lengths[i] for i in indices]
