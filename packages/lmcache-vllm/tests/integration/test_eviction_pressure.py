# SPDX-License-Identifier: Apache-2.0
"""A prompt larger than lmcache's CPU tier, repeated, on real vLLM (CPU): a stable hit.

The CPU tier holds 4 chunks; the prompt has 7. The first run stores its head (4 chunks); every
later run must hit those 4 chunks again, with greedy output identical to a run without any
connector. Before the prefix-keeping eviction order (issue 25), storing the tail evicted the
head it extends, and the hit changed from run to run (256, 64, 256, ... tokens here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcache_vllm.testing import make_prompt

from .conftest import CHUNK, MAX_TOKENS, engine_kwargs, ktc, live_engine, shutdown_engine

pytestmark = pytest.mark.slow

ROOM = 4  # chunks the CPU tier holds
PROMPT = make_prompt(7 * CHUNK, 25)  # 7 full chunks
# The conftest's tiny Llama in float32: 2 layers, K and V of 2 heads x 64 per token.
CHUNK_BYTES = 2 * CHUNK * (2 * 2 * 64) * 4


def _greedy(model_dir: Path, kv_transfer_config: dict[str, Any] | None, runs: int) -> list[Any]:
    """``runs`` requests of PROMPT in one engine, vLLM's own prefix cache reset after each, so
    every hit comes from lmcache: ``[(output tokens, num_cached_tokens, tier chunks), ...]``."""
    from vllm import LLM, SamplingParams

    overrides: dict[str, Any] = {"kv_transfer_config": kv_transfer_config}
    if kv_transfer_config is None:
        overrides["enable_prefix_caching"] = False
    llm = LLM(**engine_kwargs(model_dir, **overrides))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = []
        for _ in range(runs):
            (o,) = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
            assert llm.reset_prefix_cache()  # keeps the connector's store
            chunks = len(live_engine().tier) if kv_transfer_config is not None else 0
            out.append((list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), chunks))
        if kv_transfer_config is not None:
            engine = live_engine()
            md = engine.metadata
            chunk_bytes = md.num_layers * CHUNK * md.kv_width * md.kv_dtype.itemsize
            assert chunk_bytes == CHUNK_BYTES, "the tiny model's geometry changed"
            assert engine.pool.budget_bytes == ROOM * CHUNK_BYTES
        return out
    finally:
        shutdown_engine(llm)


def test_a_prompt_larger_than_the_cpu_tier_hits_the_same_every_time(model_dir: Path) -> None:
    (reference,) = _greedy(model_dir, None, 1)
    size_gb = ROOM * CHUNK_BYTES / 1024**3  # exact: a power of two
    runs = _greedy(model_dir, ktc(max_local_cpu_size=size_gb), 4)
    assert all(tokens == reference[0] for tokens, _, _ in runs)
    cached = [c for _, c, _ in runs]
    assert cached[0] == 0
    assert cached[1] > 0 and cached[1:] == [cached[1]] * 3, cached
    assert cached[1] == ROOM * CHUNK  # the 4 head chunks, every time
    assert [chunks for _, _, chunks in runs] == [ROOM] * 4
