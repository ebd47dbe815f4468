# SPDX-License-Identifier: Apache-2.0
"""Real vLLM (CPU build) in this process: a tiny random Llama, engines built per test.

Engines run single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the multiprocess and server
tests start subprocesses. Greedy outputs are compared token for token with a run of the same
prompt without any connector (computed once per session).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import vllm  # noqa: F401  - in `nox -s vllm` a missing or broken vLLM must fail, not skip

from lmcache_vllm.testing import build_tiny_llama, make_prompt

CHUNK = 64
BLOCK = 32
MAX_TOKENS = 12

PROMPTS: dict[str, list[int]] = {
    "p300": make_prompt(300, 1),  # 4 full chunks + 44-token tail
    "p256": make_prompt(256, 2),  # exactly 4 chunks: a full hit
    "c200": make_prompt(200, 4),
    "d230": make_prompt(230, 6),
}
PROMPTS["p300_ext"] = PROMPTS["p300"] + make_prompt(90, 5)  # extends p300 -> partial hit

MODULE_PATH_KTC: dict[str, Any] = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_connector_module_path": "lmcache_vllm.connector",
    "kv_role": "kv_both",
}


def ktc(base: dict[str, Any] | None = None, **lmcache: Any) -> dict[str, Any]:
    """A kv_transfer_config with ``lmcache.<key>`` extra config (chunk_size 64 by default)."""
    out = dict(base or MODULE_PATH_KTC)
    extra = {"lmcache.chunk_size": CHUNK, "lmcache.max_local_cpu_size": 0.25}
    extra.update({f"lmcache.{k}": v for k, v in lmcache.items()})
    out["kv_connector_extra_config"] = extra
    return out


@pytest.fixture(scope="session")
def model_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / f"lmcache-vllm-tests-{os.getuid()}" / "tiny-llama"
    return build_tiny_llama(
        folder,
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=2048,
    )


def engine_kwargs(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    from lmcache_vllm.testing import vllm_engine_kwargs

    kw = vllm_engine_kwargs(
        model_dir,
        block_size=BLOCK,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        disable_log_stats=False,
    )
    kw.update(overrides)
    return kw


def shutdown_engine(llm: Any) -> None:
    from lmcache_vllm.testing import shutdown_llm

    shutdown_llm(llm)


@dataclass
class Result:
    tokens: list[list[int]]
    cached: list[int]
    metrics: dict[str, float]


def metrics_of(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = float(value)
    return out


@pytest.fixture
def run(model_dir: Path):
    """``run(prompts, kv_transfer_config, **engine_overrides) -> Result`` in a fresh engine."""

    def _run(
        prompts: Sequence[list[int]], kv_transfer_config: dict[str, Any] | None, **overrides: Any
    ) -> Result:
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=kv_transfer_config, **overrides))
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return Result(
                tokens=[list(o.outputs[0].token_ids) for o in outs],
                cached=[int(o.num_cached_tokens or 0) for o in outs],
                metrics=metrics_of(llm),
            )
        finally:
            shutdown_engine(llm)

    return _run


@pytest.fixture(scope="session")
def baseline(model_dir: Path) -> dict[str, list[int]]:
    """Greedy output of every prompt without a connector, each computed on its own."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model_dir, enable_prefix_caching=False))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = {}
        for name, prompt in PROMPTS.items():
            (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            out[name] = list(o.outputs[0].token_ids)
        return out
    finally:
        shutdown_engine(llm)


@pytest.fixture(autouse=True)
def fresh_lmcache() -> Iterator[None]:
    """Each test starts with an empty process-wide lmcache tier."""
    from lmcache.tiers import reset_process_cpu_tiers

    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


def live_engine():
    """The newest worker-side LMCacheEngine of this process."""
    from lmcache_vllm.vllm_v1_adapter import live_engines

    engines = live_engines()
    assert engines, "no lmcache engine is alive in this process"
    return engines[-1]


def process_tier():
    """The process-wide CPU tier the connectors store into."""
    from lmcache import tiers

    assert tiers.process_tier._tiers, "no process-wide tier was created"
    return next(iter(tiers.process_tier._tiers.values()))
