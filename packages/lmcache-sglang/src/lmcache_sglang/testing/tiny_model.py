# SPDX-License-Identifier: Apache-2.0
"""SGLang settings for the tiny random Llama of :mod:`lmcache.testing.tiny_model`.

:func:`build_tiny_llama`, :func:`make_prompt`, ``FIRST_WORD_ID`` and ``SPECIAL_TOKENS`` live in
:mod:`lmcache.testing.tiny_model` (shared with lmcache-vllm) and are re-exported here. SGLang loads
the folder like any Hugging Face checkpoint (set ``HF_HUB_OFFLINE=1``).

This module never imports sglang.
"""

from __future__ import annotations

import os
from typing import Any

from lmcache.testing.tiny_model import FIRST_WORD_ID, SPECIAL_TOKENS, build_tiny_llama, make_prompt

__all__ = [
    "FIRST_WORD_ID",
    "SPECIAL_TOKENS",
    "build_tiny_llama",
    "make_prompt",
    "sglang_engine_kwargs",
]


def sglang_engine_kwargs(model_dir: str | os.PathLike[str], **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine(...)`` known to work on SGLang's CPU engine (0.5.23).

    CPU device, ``torch_native`` attention, no CUDA graph, 16-token pages, a 4096-token KV pool,
    bfloat16, one tokenizer worker. ``overrides`` replace or add keys (e.g. the linker flags).
    Set ``SGLANG_USE_CPU_ENGINE=1`` before importing sglang, and build engines under an
    ``if __name__ == "__main__":`` guard (SGLang spawns its scheduler).
    """
    kwargs: dict[str, Any] = {
        "model_path": str(model_dir),
        "device": "cpu",
        "attention_backend": "torch_native",
        "disable_cuda_graph": True,
        "mem_fraction_static": 0.05,
        "max_total_tokens": 4096,
        "page_size": 16,
        "dtype": "bfloat16",
        "random_seed": 0,
        "log_level": "error",
    }
    kwargs.update(overrides)
    return kwargs
