"""The engine's own forward pass of a Llama-style decoder over KV slots (`slot_kv`).

It runs the Hugging Face model's own modules (embeddings, norms, projections, MLPs, head), so
weight updates by name land where it reads them, but does attention itself: each token's keys
and values are written into its request's slot at its position, and queries attend to the
slot's first `width` columns under a mask `column <= position`. Shapes depend only on (rows,
tokens per row, width), never on the lengths inside, which is what lets `decode_graphs`
capture one decode step per batch and width bucket. Llama, Qwen2 and Qwen3 (its q/k norms)
are supported; `unsupported_reason` says why another model is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.engine.prefill_attention import prefill_kernels
from services.engine.slot_kv import SlotKV

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def unsupported_reason(model: Any) -> str | None:
    """Why the slots forward cannot run `model` (a transformers causal LM), or None."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (its frequencies depend on the sequence length)"
    return None


@dataclass
class PrefillRow:
    """One request's next prompt piece: `tokens` at positions start.. of `slot`."""

    slot: int
    tokens: list[int]
    start: int
    all_logits: bool


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotModel:
    """Forward of rows of tokens, each row writing into and reading from one KV slot."""

    def __init__(self, model: Any, kv: SlotKV) -> None:
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.scaling: float = attn.scaling
        self.kv = kv
        self.kv_heads = kv.keys[0].shape[1]
        self.groups = model.config.num_attention_heads // self.kv_heads
        device = kv.keys[0].device
        positions = torch.arange(kv.slot_len, device=device)[None, :]
        probe = torch.zeros((), dtype=kv.keys[0].dtype, device=device)
        cos, sin = inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [slot_len, head_dim]
        self.columns = torch.arange(kv.slot_len, device=device)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        writes: tuple[torch.Tensor, torch.Tensor],
        read_slots: torch.Tensor | slice,
        width: int,
    ) -> torch.Tensor:
        """Hidden states [R, n, hidden] after the final norm.

        ids, positions: [R, n]; writes: (slot, column) [R, n] each, where each token's keys and
        values go (a padding token's to the sink slot); read_slots: [R], the slot each row
        attends to, or a slice of R consecutive slots (read as a view, no copy); width: columns
        attended (> every real position).
        """
        mask = self.columns[:width][None, None, :] <= positions[:, :, None]  # [R, n, W]
        mask = mask[:, None]  # [R, 1, n, W]
        if ids.shape[1] > 1:  # query rows are ordered (group, token): see _attention
            mask = mask.repeat(1, 1, self.groups, 1)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        hidden = self.embed(ids)
        for index, layer in enumerate(self.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = self._attention(
                index, layer.self_attn, hidden, (cos, sin), mask, writes, read_slots, width,
            )
            hidden = residual + hidden
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def _attention(
        self,
        index: int,
        attn: Any,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        writes: tuple[torch.Tensor, torch.Tensor],
        read_slots: torch.Tensor | slice,
        width: int,
    ) -> torch.Tensor:
        rows, n, _ = hidden.shape
        d, kv_heads, groups = self.head_dim, self.kv_heads, self.groups
        q = attn.q_proj(hidden).view(rows, n, kv_heads * groups, d)
        k = attn.k_proj(hidden).view(rows, n, kv_heads, d)
        v = attn.v_proj(hidden).view(rows, n, kv_heads, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = self.kv.keys[index], self.kv.values[index]
        slots, cols = writes[0].reshape(-1), writes[1].reshape(-1)
        keys[slots, :, cols] = k.reshape(-1, kv_heads, d)
        values[slots, :, cols] = v.reshape(-1, kv_heads, d)
        if isinstance(read_slots, slice):
            k_all, v_all = keys[read_slots, :, :width], values[read_slots, :, :width]
        else:
            k_all = keys[:, :, :width].index_select(0, read_slots)  # [R, Hkv, W, D]
            v_all = values[:, :, :width].index_select(0, read_slots)
        # The query heads sharing a KV head attend as one longer query: no KV repeat.
        q = q.view(rows, n, kv_heads, groups, d).permute(0, 2, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q.reshape(rows, kv_heads, groups * n, d), k_all, v_all, attn_mask=mask,
            scale=self.scaling,
        )
        out = out.view(rows, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4)
        return attn.o_proj(out.reshape(rows, n, kv_heads * groups * d))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def prefill(self, rows: list[PrefillRow]) -> list[torch.Tensor]:
        """Forward each row's tokens at positions start.. into its slot, as one right-padded
        batch (columns before `start` already hold the row's earlier tokens); returns per
        row logits [n, V] if it asks for all, else [1, V] (its last token)."""
        width = max(row.start + len(row.tokens) for row in rows)
        n = max(len(row.tokens) for row in rows)
        offsets = torch.arange(n)
        ids = torch.zeros((len(rows), n), dtype=torch.long)
        positions = torch.zeros((len(rows), n), dtype=torch.long)
        slots = torch.full((len(rows), n), self.kv.sink, dtype=torch.long)
        columns = offsets.repeat(len(rows), 1)  # padding: sink columns 0..n-1
        for i, row in enumerate(rows):
            m = len(row.tokens)
            ids[i, :m] = torch.tensor(row.tokens)
            positions[i] = (row.start + offsets).clamp(max=self.kv.slot_len - 1)
            slots[i, :m] = row.slot
            columns[i, :m] = positions[i, :m]
        device = self.cos.device
        read = torch.tensor([row.slot for row in rows], device=device)
        with prefill_kernels("engine" if device.type == "cuda" else "torch"):
            hidden = self.forward(ids.to(device), positions.to(device),
                                  (slots.to(device), columns.to(device)), read, width)
        picked = [hidden[i, : len(row.tokens)] if row.all_logits
                  else hidden[i, len(row.tokens) - 1 : len(row.tokens)]
                  for i, row in enumerate(rows)]
        logits = self.logits(torch.cat(picked))
        return list(logits.split([len(p) for p in picked]))

    def decode(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, width: int,
        read_slots: torch.Tensor | slice | None = None,
    ) -> torch.Tensor:
        """One token per row (ids, positions, slots: [B]); returns logits [B, V]. `read_slots`:
        the same slots as a slice when they are consecutive (default: `slots`)."""
        positions = positions[:, None]
        read = slots if read_slots is None else read_slots
        hidden = self.forward(ids[:, None], positions, (slots[:, None], positions), read, width)
        return self.logits(hidden[:, 0])


def choose_decode_backend(setting: str, model: Any, device: torch.device) -> str:
    """`slots` or `transformers` for the engine.decode_backend `setting` (auto, slots,
    transformers); raises ConfigError when slots is asked for a model it cannot run."""
    from services.common.errors import ConfigError

    reason = unsupported_reason(model)
    if setting == "slots" and reason is not None:
        raise ConfigError(f"engine.decode_backend = slots cannot run this model: {reason}; "
                          "use transformers")
    if setting == "auto":
        return "slots" if reason is None else "transformers"
    return setting
