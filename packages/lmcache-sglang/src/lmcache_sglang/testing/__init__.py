# SPDX-License-Identifier: Apache-2.0
"""Test helpers for lmcache-sglang: a tiny random Llama built locally, prompts, engine settings.

Importing this package never imports sglang. :mod:`lmcache_sglang.testing.corrupt_linker` (a
linker that loads noise, the control of the end-to-end tests) imports it.
"""

from __future__ import annotations

from lmcache_sglang.testing.tiny_model import (
    FIRST_WORD_ID,
    SPECIAL_TOKENS,
    build_tiny_llama,
    make_prompt,
    sglang_engine_kwargs,
)

__all__ = [
    "FIRST_WORD_ID",
    "SPECIAL_TOKENS",
    "build_tiny_llama",
    "make_prompt",
    "sglang_engine_kwargs",
]
