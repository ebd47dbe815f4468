# SPDX-License-Identifier: Apache-2.0
"""A promised hit survives eviction pressure on real vLLM (CPU).

Prompt A is stored. Then B (long) and A arrive together with vLLM's KV cache too small for both:
vLLM looks A up (lmcache leases A's chunks on every rank), cannot allocate it, and runs B first.
B's saves fill a tier that holds six chunks, so they must evict; A's leased chunks are not
evictable. When B is done, A is scheduled and loads its hit: identical output, no load errors.
Without the lease, B's saves evict A's chunks and A recomputes everything.
"""

from __future__ import annotations

from vllm import LLM, SamplingParams

from lmcache_vllm.testing import make_prompt

from .conftest import CHUNK, MAX_TOKENS, engine_kwargs, ktc, metrics_of, shutdown_engine

CHUNK_BYTES = 2 * CHUNK * 2 * 2 * 64 * 4  # layers x tokens x (K+V) x kv heads x head x fp32
BLOCK_BYTES = 2 * 2 * 2 * 32 * 64 * 4  # layers x (K+V) x kv heads x block 32 x head x fp32


def test_leased_hit_survives_eviction_while_the_request_waits(model_dir):
    a = make_prompt(256, seed=31, vocab_size=1000)
    b = make_prompt(600, seed=32, vocab_size=1000)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    ref = LLM(**engine_kwargs(model_dir, enable_prefix_caching=False))
    try:
        (want_a,) = ref.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)
    finally:
        shutdown_engine(ref)

    tier_gb = 6 * CHUNK_BYTES / 1024**3
    cfg = ktc(max_local_cpu_size=tier_gb)
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kv_transfer_config=cfg,
            kv_cache_memory_bytes=25 * BLOCK_BYTES,  # B (20 blocks) and A (9) do not fit together
            max_model_len=640,
            max_num_seqs=2,
        )
    )
    try:
        llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)  # A stored: 4 chunks
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": b}, {"prompt_token_ids": a}], sp, use_tqdm=False)
        _, out_a = outs
        assert list(out_a.outputs[0].token_ids) == list(want_a.outputs[0].token_ids)
        assert out_a.num_cached_tokens == 224  # A's hit, to a block boundary before its last token
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m
        assert m.get("vllm:lmcache_loaded_tokens", 0) >= 224, m
    finally:
        shutdown_engine(llm)
