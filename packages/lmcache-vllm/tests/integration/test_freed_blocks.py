# SPDX-License-Identifier: Apache-2.0
"""A finished request's blocks, reused by the very next step, are saved as they were (real vLLM).

lmcache lets vLLM free a finished request's blocks at once (``request_finished`` returns
``False``) and orders every later write of vLLM's pages after the queued saves' reads instead
(each step starts with a fence). Here the copy thread is made slow (every queued copy sleeps
first) and vLLM's KV cache holds a single request: prompt A finishes in its prefill step, and the
next step's prompt B is written into A's freed blocks while A's copy has not read them yet. A's
stored chunks must still be A's KV: after a reset, A hits and answers exactly as without lmcache.
Without the fence, A's chunks hold B's KV and A's answer changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm import LLM, SamplingParams

from lmcache_vllm.testing import slow_save_copies

from .conftest import BLOCK, MAX_TOKENS, PROMPTS, engine_kwargs, ktc, metrics_of, shutdown_engine

BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 64 * 4  # layers x (K+V) x kv heads x block x head x fp32


@pytest.fixture
def slow_copies() -> Iterator[set[Any]]:
    with slow_save_copies(0.3) as queues:
        yield queues


@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
def test_blocks_freed_and_reused_at_once_are_saved_as_they_were(
    model_dir, baseline, slow_copies, layerwise
):
    a, b = PROMPTS["p256"], PROMPTS["p300"]  # 8 and 10 blocks of 32 tokens
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kv_transfer_config=ktc(use_layerwise=layerwise),
            # 11 blocks (vLLM keeps one back): B can only run in the blocks A just freed
            kv_cache_memory_bytes=11 * BLOCK_BYTES,
            max_model_len=320,
            max_num_seqs=1,  # A alone in its prefill step, B alone in the next
        )
    )
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in (a, b)], one, use_tqdm=False)
        assert [o.outputs[0].token_ids[0] for o in outs] == [
            baseline["p256"][0],
            baseline["p300"][0],
        ]
        assert slow_copies, "no save was queued"
        assert all(q.wait(timeout=30) for q in slow_copies)  # every save is published
        assert llm.reset_prefix_cache()  # vLLM's own cache must not serve the next request

        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (out_a,) = llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)
        assert out_a.num_cached_tokens == 224  # A's hit, to a block boundary before its last token
        assert list(out_a.outputs[0].token_ids) == baseline["p256"]
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m
    finally:
        shutdown_engine(llm)
