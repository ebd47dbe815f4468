# SPDX-License-Identifier: Apache-2.0
"""End-to-end on real vLLM (CPU): store, then hit in a fresh engine; output identical."""

from __future__ import annotations

import pytest
import torch

from lmcache.keys import chunk_keys

from .conftest import CHUNK, MODULE_PATH_KTC, PROMPTS, ktc, process_tier

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"


def test_store_then_hit_in_fresh_engine(run, baseline):
    cold = run([PROMPTS["p300"]], ktc())
    assert cold.tokens[0] == baseline["p300"]
    assert cold.cached == [0]
    warm = run([PROMPTS["p300"]], ktc())
    assert warm.tokens[0] == baseline["p300"]
    assert warm.cached == [256]  # 4 full chunks; the 44-token tail is not stored by default
    assert warm.metrics[EXTERNAL_HITS] == 256
    lm = {k: v for k, v in warm.metrics.items() if k.startswith("vllm:lmcache_")}
    assert lm.get("vllm:lmcache_loaded_tokens") == 256, lm
    assert lm.get("vllm:lmcache_stored_tokens") == 0, lm  # everything was stored already
    assert lm.get("vllm:lmcache_failed_load_tokens", 0) == 0, lm


def test_partial_hit_prompt_extends_stored_prefix(run, baseline):
    run([PROMPTS["p300"]], ktc())
    ext = run([PROMPTS["p300_ext"]], ktc())
    assert ext.tokens[0] == baseline["p300_ext"]
    assert ext.cached == [256]
    again = run([PROMPTS["p300_ext"]], ktc())  # the extension was stored too: 384 of 390
    assert again.tokens[0] == baseline["p300_ext"]
    assert again.cached == [384]


def test_full_hit_recomputes_last_token(run, baseline):
    run([PROMPTS["p256"]], ktc())
    warm = run([PROMPTS["p256"]], ktc())
    assert warm.tokens[0] == baseline["p256"]
    # vLLM computes the last prompt token, and the hit ends on a block boundary (block 32)
    assert warm.cached == [224]


@pytest.mark.parametrize(("save_unfull", "expected"), [(False, 256), (True, 288)])
def test_partial_last_chunk(run, baseline, save_unfull, expected):
    cfg = ktc(save_unfull_chunk=save_unfull)
    run([PROMPTS["p300"]], cfg)
    warm = run([PROMPTS["p300"]], cfg)
    assert warm.tokens[0] == baseline["p300"]
    assert warm.cached == [expected]


def test_two_prompts_interleaved_in_one_batch(run, baseline):
    prompts = [PROMPTS["c200"], PROMPTS["d230"]]
    cold = run(prompts, ktc())
    assert cold.tokens == [baseline["c200"], baseline["d230"]]
    warm = run([*prompts, PROMPTS["p300"]], ktc())
    assert warm.tokens == [baseline["c200"], baseline["d230"], baseline["p300"]]
    assert warm.cached == [192, 192, 0]


def test_layerwise_mode(run, baseline):
    cfg = ktc(use_layerwise=True)
    run([PROMPTS["p300"]], cfg)
    warm = run([PROMPTS["p300"]], cfg)
    assert warm.tokens[0] == baseline["p300"]
    assert warm.cached == [256]


def test_layerwise_and_batched_store_the_same_bytes(run):
    run([PROMPTS["p300"]], ktc())
    tier = process_tier()
    batched = {k: e.lease.tensor.clone() for k, e in tier._entries.items()}
    tier.clear()
    run([PROMPTS["p300"]], ktc(use_layerwise=True))
    layerwise = {k: e.lease.tensor.clone() for k, e in tier._entries.items()}
    assert batched.keys() == layerwise.keys() and len(batched) == 4
    for key, value in batched.items():
        torch.testing.assert_close(layerwise[key], value, rtol=0, atol=0)


def test_corrupted_kv_changes_the_output(run, baseline):
    """Control: the loaded KV is really used (wrong bytes -> different tokens)."""
    cfg = ktc(checksum=False)
    run([PROMPTS["p300"]], cfg)
    tier = process_tier()
    assert len(tier) == 4
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # the pool's slabs were allocated inside vLLM's inference mode
        for entry in tier._entries.values():
            t = entry.lease.tensor
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) * 5)
    warm = run([PROMPTS["p300"]], cfg)
    assert warm.cached == [256]
    assert warm.tokens[0] != baseline["p300"]


def test_checksum_failure_is_recomputed_not_loaded(run, baseline):
    """Corrupt bytes with checksums on: the lookup verifies the chunks it leases, so it claims
    only the intact prefix; vLLM computes the rest and no promised load fails."""
    run([PROMPTS["p300"]], ktc())
    tier = process_tier()
    (owner,) = {entry.owner for entry in tier._entries.values()}  # the engine's fingerprint
    keys = chunk_keys(PROMPTS["p300"], owner, CHUNK, salt="\0")  # config salt "" + "\0" + ""
    good = {2: tier._entries[keys[2]].lease.tensor.clone()}
    with torch.inference_mode():
        for key in keys[2:4]:  # chunks 2 and 3
            tier._entries[key].lease.tensor.mul_(-3)
    warm = run([PROMPTS["p300"]], ktc())
    assert warm.tokens[0] == baseline["p300"]
    assert warm.cached == [128]  # chunks 0-1 only
    lm = {k: v for k, v in warm.metrics.items() if k.startswith("vllm:lmcache_")}
    assert lm.get("vllm:lmcache_failed_load_tokens", 0) == 0, lm
    # the mismatching chunk 2 was dropped at lookup and stored again from vLLM's recompute
    torch.testing.assert_close(tier._entries[keys[2]].lease.tensor, good[2], rtol=0, atol=0)


@pytest.mark.parametrize(
    "config",
    [
        {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
        MODULE_PATH_KTC,
        {"kv_connector": "LMCacheConnector", "kv_role": "kv_both"},
    ],
    ids=["in-tree-name", "module-path", "plugin-name"],
)
def test_three_loading_ways(run, baseline, config):
    cfg = ktc(config)
    run([PROMPTS["c200"]], cfg)
    warm = run([PROMPTS["c200"]], cfg)
    assert warm.tokens[0] == baseline["c200"]
    assert warm.cached == [192]


@pytest.mark.parametrize(
    "config",
    [{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, MODULE_PATH_KTC],
    ids=["in-tree-name", "module-path"],
)
def test_reset_prefix_cache_with_connector_empties_lmcache(model_dir, baseline, config):
    """Every loading way, vLLM's in-tree wrapper included, forwards reset_connector and
    lmcache's stats."""
    from vllm import LLM, SamplingParams

    from .conftest import MAX_TOKENS, engine_kwargs, metrics_of, shutdown_engine

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc(config)))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompt = [{"prompt_token_ids": PROMPTS["p300"]}]
        llm.generate(prompt, sp, use_tqdm=False)
        assert llm.reset_prefix_cache()  # vLLM's own cache only: lmcache still hits
        (o,) = llm.generate(prompt, sp, use_tqdm=False)
        assert o.num_cached_tokens == 256 and list(o.outputs[0].token_ids) == baseline["p300"]
        assert metrics_of(llm).get("vllm:lmcache_loaded_tokens") == 256
        assert llm.reset_prefix_cache(reset_connector=True)
        assert len(process_tier()) == 0
        (o,) = llm.generate(prompt, sp, use_tqdm=False)
        assert o.num_cached_tokens == 0 and list(o.outputs[0].token_ids) == baseline["p300"]
    finally:
        shutdown_engine(llm)


@pytest.mark.parametrize(
    "config",
    [{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, MODULE_PATH_KTC],
    ids=["in-tree-name", "module-path"],
)
def test_engine_shutdown_reaches_lmcache(model_dir, baseline, config):
    """Shutting the engine down shuts lmcache's worker down through every loading way (vLLM's
    in-tree wrapper does not forward ``shutdown`` itself): its cache engine is closed, its lookup
    socket removed, and what it saved stays for the next engine."""
    from vllm import LLM, SamplingParams

    from lmcache_vllm.lookup_sockets import engine_key, socket_path

    from .conftest import MAX_TOKENS, engine_kwargs, live_engine, shutdown_engine

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc(config)))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": PROMPTS["c200"]}], sp, use_tqdm=False)
        engine = live_engine()
        sock = socket_path(engine_key(llm.llm_engine.vllm_config), 0)
        assert sock.exists(), "no lookup socket while the engine runs"
    finally:
        shutdown_engine(llm)
    assert engine._closed, "the engine's shutdown did not reach lmcache's worker"
    assert not sock.exists(), "the lookup socket outlived its engine"
    assert len(process_tier()) >= 3  # c200's three full chunks stay for a later engine


def test_aborted_request_leaks_no_leases(model_dir):
    from vllm import LLM, SamplingParams

    from .conftest import engine_kwargs, shutdown_engine

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc(save_decode_cache=True)))
    try:
        engine = llm.llm_engine
        sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        engine.add_request("victim", {"prompt_token_ids": PROMPTS["p300"]}, sp)
        engine.add_request("other", {"prompt_token_ids": PROMPTS["c200"]}, sp)
        for _ in range(40):  # prefill + some decode steps, saving as it goes
            engine.step()
        engine.abort_request(["victim", "other"])
        for _ in range(3):
            engine.step()
        assert not engine.has_unfinished_requests()
        tier = process_tier()
        assert len(tier) >= 4
        for entry in tier._entries.values():
            assert entry.lease.ref_count == 1, "a chunk is still leased by someone"
        tier.clear()
        assert tier.pool.used_bytes == 0, "host memory still leased after clearing the tier"
    finally:
        shutdown_engine(llm)


def test_prompt_logprobs_are_computed_not_loaded(model_dir):
    """Prompt logprobs need every prompt token's logits: such a request never loads from
    lmcache (its logprobs equal the cold run's, every position present) but its KV is stored,
    and an ordinary request of the same prompt then hits."""
    from vllm import LLM, SamplingParams

    from .conftest import MAX_TOKENS, engine_kwargs, shutdown_engine

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc()))
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        lp = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1
        )
        prompt = [{"prompt_token_ids": PROMPTS["p300"]}]
        (cold,) = llm.generate(prompt, lp, use_tqdm=False)
        assert llm.reset_prefix_cache()
        (again,) = llm.generate(prompt, lp, use_tqdm=False)
        assert again.num_cached_tokens == 0
        assert list(again.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
        assert len(again.prompt_logprobs) == len(PROMPTS["p300"])
        for want, got in zip(cold.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
            assert want.keys() == got.keys()
            for tok, w in want.items():
                assert got[tok].logprob == pytest.approx(w.logprob, abs=1e-5)
        assert llm.reset_prefix_cache()
        (hit,) = llm.generate(prompt, plain, use_tqdm=False)
        assert hit.num_cached_tokens == 256
        assert list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    finally:
        shutdown_engine(llm)


@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
def test_chunked_prefill_stores_across_steps_and_hits(model_dir, baseline, layerwise):
    """With 64-token prefill steps a prompt's chunks are computed, and saved, over several
    steps; a fresh engine then hits every stored chunk and its output equals vLLM's alone."""
    from vllm import LLM, SamplingParams

    from .conftest import MAX_TOKENS, engine_kwargs, shutdown_engine

    names = ("p300", "p300_ext", "c200")
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for _ in range(2):  # store, then hit in a fresh engine
        llm = LLM(
            **engine_kwargs(
                model_dir,
                kv_transfer_config=ktc(use_layerwise=layerwise),
                max_num_batched_tokens=64,
                enable_chunked_prefill=True,
                max_num_seqs=4,
            )
        )
        try:
            outs = llm.generate(
                [{"prompt_token_ids": PROMPTS[n]} for n in names], sp, use_tqdm=False
            )
            runs.append([(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs])
        finally:
            shutdown_engine(llm)
    assert [c for _, c in runs[1]] == [256, 384, 192]  # every full chunk, from lmcache
    assert [t for t, _ in runs[1]] == [baseline[n] for n in names]
    assert [t for t, _ in runs[0]] == [baseline[n] for n in names]
