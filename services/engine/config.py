"""The [engine] section: the built-in engine's settings (for `riptide serve engine`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import StrictModel


class EngineConfig(StrictModel):
    """Settings of one built-in engine process."""

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(30000, ge=0, le=65535, description="HTTP port of the SGLang-compatible API")
    api_key: str | None = Field(
        None, min_length=8, repr=False,
        description="bearer key every request but /health* and /metrics must carry, as "
        "SGLang's --api-key (None: open); best set through RIPTIDE_ENGINE_API_KEY, which keeps "
        "it off the command line")
    model_path: str | None = Field(
        None, description="Hugging Face causal LM folder (None: the engine cannot start)"
    )
    tokenizer_path: str | None = Field(None, description="tokenizer folder (default: model_path)")
    dp_size: int = Field(
        1, ge=1, le=64, description="data-parallel ranks, each with its own batch and cache"
    )
    max_running_requests: int = Field(
        64, ge=1, description="most requests decoded together in one batch, per dp rank"
    )
    max_total_num_tokens: int = Field(
        262144, ge=64, description="KV tokens a dp rank may hold in its running batch"
    )
    prefix_cache_num_tokens: int = Field(
        65536, ge=0, description="token budget of each dp rank's radix prefix cache (0: off)"
    )
    max_context_len: int | None = Field(
        None, ge=2, description="longest prompt+output in tokens (default: the model's limit)"
    )
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1 ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    num_threads: int = Field(
        1, ge=1, description="torch CPU threads per forward (raise it for models beyond tiny)"
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention kernel"
    )
    decode_backend: Literal["auto", "slots", "transformers"] = Field(
        "auto",
        description="running batch: slots (a preallocated KV slot per request, the engine's own "
        "forward, CUDA graphs on GPU), transformers (the model's forward over a left-padded "
        "cache); auto: slots for Llama/Qwen2/Qwen3-style models (CPU and CUDA), else "
        "transformers (and whenever routed experts are recorded)",
    )
    cuda_graph: bool = Field(
        True, description="capture the slots decode step as CUDA graphs (per batch and KV width)"
    )
    flat_weights: bool = Field(
        True, description="keep the parameters as views of one buffer per dtype in checkpoint "
        "order, so a weight update sent in that order loads as one copy (False: one allocation "
        "per parameter, as loaded)")
    weight_version: str = Field("default", description="weight version reported at start")
    served_model_name: str | None = Field(None, description="model name in metrics and info")
    random_seed: int = Field(0, description="seed of sampling for requests without sampling_seed")
    weight_update_timeout_s: float = Field(
        600.0, gt=0, description="rendezvous and broadcast timeout of the weight-update group"
    )
    contract: Literal["current", "deprecated"] = Field(
        "current",
        description="SGLang route names served: current (0.5.23's, plus the deprecated aliases "
        "it keeps) or deprecated (only the older /get_* names, as older SGLang trees)",
    )
    enable_return_routed_experts: bool = Field(
        False, description="record each token's routed experts per MoE layer, returned to "
        "requests with return_routed_experts (SGLang's flag; MoE models only)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype float16 is not supported on cpu: use float32 or bfloat16")
        return self

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
