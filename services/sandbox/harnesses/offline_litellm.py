"""litellm as the harnesses use it: offline, quiet, and reaching only the episode's gateway.

Harbor's Terminus-2 and mini-swe-agent both call the model through litellm. Left to its
defaults, litellm downloads a model-price catalog from the internet when it is imported and
may fetch tokenizers; neither is reachable (or wanted) from a training node. Its offline mode
makes it use the copies bundled with the package. Call `offline_litellm()` before the harness
package is imported: the settings are read at import time.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType


def offline_litellm() -> ModuleType:
    """Configure litellm for offline use (idempotent) and return the module."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    os.environ["LITELLM_OFFLINE_MODE"] = "true"
    import litellm

    litellm.suppress_debug_info = True
    litellm.telemetry = False
    litellm.disable_end_user_cost_tracking = True
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):  # one INFO line per call
        logging.getLogger(name).setLevel(logging.WARNING)
    return litellm


def litellm_model_name(model: str) -> str:
    """The name under which litellm sends `model` to an OpenAI-compatible base URL."""
    return f"openai/{model}"
