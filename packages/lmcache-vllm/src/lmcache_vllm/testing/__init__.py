# SPDX-License-Identifier: Apache-2.0
"""Test helpers for lmcache-vllm: tiny random models built locally (a Llama; a Gemma-3 and a
Nemotron-H for hybrid KV caches), prompts, CPU engine settings
and fault injection (:func:`slow_save_copies`).

Importing this package never imports vllm (only ``transformers``/``tokenizers``/``torch`` when a
model is actually built).
"""

from __future__ import annotations

from lmcache_vllm.testing.faults import slow_save_copies
from lmcache_vllm.testing.tiny_lora import build_random_lora
from lmcache_vllm.testing.tiny_model import (
    FIRST_WORD_ID,
    SPECIAL_TOKENS,
    build_tiny_gemma3,
    build_tiny_llama,
    build_tiny_nemotron_h,
    make_prompt,
    shutdown_llm,
    vllm_engine_kwargs,
)
from lmcache_vllm.testing.vllm_config import connector_vllm_config

__all__ = [
    "FIRST_WORD_ID",
    "SPECIAL_TOKENS",
    "build_random_lora",
    "build_tiny_gemma3",
    "build_tiny_llama",
    "build_tiny_nemotron_h",
    "connector_vllm_config",
    "make_prompt",
    "shutdown_llm",
    "slow_save_copies",
    "vllm_engine_kwargs",
]
