"""A tiny random Llama-style model with a local byte-level tokenizer (no download).

It is the default model of the local stack and of the tests: small enough to run fast on a
laptop CPU, but a real transformers checkpoint that any engine can load. With
`num_experts` it is a Qwen2-MoE model instead (top-2 routed experts and a shared expert per
layer), the tiny MoE model of the routing-replay tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-to-printable-character map used by byte-level pre-tokenizers."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def build_tokenizer():  # -> PreTrainedTokenizerFast
    """A byte-level tokenizer: one token per byte (256) plus the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in _byte_symbols().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def create_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    num_experts: int = 0,
) -> Path:
    """Write a random Llama-style causal LM (Qwen2-MoE with `num_experts`) with a byte-level
    tokenizer to `path`; returns it."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    vocab_size = (len(tokenizer) + 7) // 8 * 8
    config_class: Any = Qwen2MoeConfig if num_experts else LlamaConfig
    model_class: Any = Qwen2MoeForCausalLM if num_experts else LlamaForCausalLM
    moe: dict[str, Any] = dict(
        num_experts=num_experts, num_experts_per_tok=2, norm_topk_prob=False,
        moe_intermediate_size=intermediate_size // 2,
        shared_expert_intermediate_size=intermediate_size) if num_experts else {}
    config = config_class(
        **moe,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        # A wide init gives peaked next-token distributions, so greedy decoding has clear winners.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=eos_ids[1],
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=eos_ids[1], do_sample=False
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
