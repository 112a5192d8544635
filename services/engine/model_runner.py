"""The model: loading a Hugging Face causal LM, prefill and batched decode forwards, and
in-place weight loading by Hugging Face parameter name."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from services.common.errors import ConfigError, InvalidRequest
from services.engine.batch_kv import BatchKV
from services.engine.checkpoint_names import CheckpointNames
from services.engine.config import EngineConfig
from services.engine.flat_weights import FlatWeights
from services.engine.radix_cache import LayerKV, kv_len
from services.engine.routed_experts import RoutedExpertsRecorder
from services.engine.shared_tensors import WeightCopy
from services.engine.slot_model import choose_decode_backend
from services.engine.weight_copy import run_copy

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and tokenizer; every forward goes through here (scheduler thread only)."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.model_path:
            raise InvalidRequest("engine.model_path is not set")
        self.config = config
        torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
        model: Any = AutoModelForCausalLM.from_pretrained(
            config.model_path, dtype=self.dtype, attn_implementation=config.attn_implementation
        )
        # One buffer per dtype on the device, in checkpoint order: a sender's bucket in that
        # order loads as one copy (flat_weights.py, weight_copy.py).
        self.flat_weights = FlatWeights(model, self.device, flat=config.flat_weights)
        self.model = model.to(self.device).eval()
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.eos_token_ids = self._eos_ids()
        model_limit = getattr(self.model.config, "max_position_embeddings", None) or 32768
        self.context_len = config.max_context_len or model_limit
        setting = config.decode_backend
        if setting == "auto" and config.enable_return_routed_experts:
            setting = "transformers"  # the only backend that records routes
        self.decode_backend = choose_decode_backend(setting, self.model, self.device)
        if self.decode_backend == "slots":
            # A slot holds one request's whole sequence: that is the context this engine serves.
            self.slot_len = min(
                self.context_len, config.max_total_num_tokens // config.max_running_requests
            )
            if self.slot_len < 2:
                raise ConfigError(
                    f"engine: max_total_num_tokens {config.max_total_num_tokens} over "
                    f"max_running_requests {config.max_running_requests} leaves KV slots of "
                    f"{self.slot_len} tokens: raise max_total_num_tokens"
                )
            self.context_len = self.slot_len
        log.info("decode backend: %s", self.decode_backend)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.parameters = dict(self.model.state_dict(keep_vars=True))
        #: the newest load's received pairs, the copies they took, the pairs merged into spans
        self.last_load: dict[str, int] = {}
        self.checkpoint_names = CheckpointNames(self.parameters)
        if config.enable_return_routed_experts and self.decode_backend == "slots":
            raise ConfigError("enable_return_routed_experts needs the transformers decode backend "
                              "(engine.decode_backend = \"transformers\"): the slot backend does "
                              "not record routes yet")
        self.routed_experts = (RoutedExpertsRecorder(self.model)
                               if config.enable_return_routed_experts else None)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else value or [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @torch.inference_mode()
    def prefill(
        self, tokens: list[int], prefix: LayerKV | None, all_logits: bool = False
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Forward `tokens` after a cached prefix's KV; returns (logits [n or 1, V], batch-1 cache).

        The prefix covers tokens[:p]; only tokens[p:] are computed.
        """
        p = 0 if prefix is None else kv_len(prefix)
        if prefix is None:
            cache = DynamicCache()
        else:
            cache = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in prefix])
        ids = torch.tensor([tokens[p:]], device=self.device)
        positions = torch.arange(p, len(tokens), device=self.device)[None, :]
        if self.routed_experts is not None:
            self.routed_experts.clear()
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{self._cache_arg: cache},
        )
        if self.routed_experts is not None:
            self.routed_experts.finish_forward()
        return out.logits[0], cache

    @torch.inference_mode()
    def decode(self, last_tokens: list[int], batch: BatchKV) -> torch.Tensor:
        """One decode step for every row of `batch`; returns logits [B, V]."""
        positions = torch.tensor(batch.lengths, device=self.device)[:, None]
        mask = batch.extend_mask()
        ids = torch.tensor(last_tokens, device=self.device)[:, None]
        if self.routed_experts is not None:
            self.routed_experts.clear()
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{self._cache_arg: batch.cache},
        )
        if self.routed_experts is not None:
            self.routed_experts.finish_forward()
        return out.logits[:, -1, :]

    def decode_text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def check_weights(self, names: list[str], shapes: list[list[int]]) -> None:
        """Raise InvalidRequest naming the first unknown name or mismatched shape."""
        for name, shape in zip(names, shapes, strict=True):
            self._target(name, shape)

    def resolve(self, tensors: dict[str, torch.Tensor]) -> WeightCopy:
        """The parameter views (by Hugging Face checkpoint name; fused expert tensors give each
        expert's slice) that received tensors fill; InvalidRequest as `check_weights`."""
        targets = [self._target(name, list(t.shape)) for name, t in tensors.items()]
        return WeightCopy(targets, list(tensors.values()))

    def _target(self, name: str, shape: list[int]) -> torch.Tensor:
        param = self.checkpoint_names.view(name)
        if param is None:
            raise InvalidRequest(f"unknown parameter name {name!r}")
        if list(param.shape) != list(shape):
            raise InvalidRequest(
                f"shape of {name} is {list(param.shape)}, the request says {list(shape)}"
            )
        return param

    @torch.no_grad()
    def load_weights(self, copy: WeightCopy) -> None:
        """Received tensors into their parameter views (cast to the model dtype, moved to its
        device): weight_copy.py's copy, back-to-back runs as one span, large spans one by one
        and the rest grouped."""
        plan = copy.plan(self.flat_weights.gaps)
        run_copy(plan)
        self.last_load = {"pairs": len(copy.targets), "copies": plan.num_copies,
                          "merged_pairs": plan.merged}
        if self.device.type == "cuda":  # the sender may free shared tensors once we answer
            torch.cuda.synchronize(self.device)
