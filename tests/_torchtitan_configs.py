"""TorchTitan configs for the tests: the llama3 debug model with our checkpoint manager.

Selected with ``--module _torchtitan_configs --config <function>`` (what a user does with a
``config_registry`` module of their own).
"""

from __future__ import annotations

from typing import Any

from dcp_datastates.integrations.torchtitan import use_datastates


def llama3_debug_datastates() -> Any:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.validator.enable = False
    return use_datastates(config, enable=True, async_mode="async", keep_latest_k=2)
