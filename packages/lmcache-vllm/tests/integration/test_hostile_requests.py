# SPDX-License-Identifier: Apache-2.0
"""No request field can take the engine down.

Two levels: the scheduler-side entry points driven with hostile vLLM ``Request`` objects over a
real lookup socket and a real cache engine; then real vLLM fed hostile requests, checking each
gets vLLM's own answer (or vLLM's own rejection) and the engine keeps serving correct output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.v1.request import Request

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.metadata import LMCacheMetadata
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.scheduler.side import SchedulerSide
from lmcache_vllm.worker.lookup_server import LookupServer

from .conftest import CHUNK, MAX_TOKENS, PROMPTS, engine_kwargs, ktc, shutdown_engine


def _vllm_config(tmp_path) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", engine_id=f"hostile-{tmp_path.name}"),
        instance_id="i",
        cache_config=SimpleNamespace(block_size=32),
    )


def _request(rid: str, tokens, salt=None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, cache_salt=salt)


def _sched_out(new=(), finished=()):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={n.req_id: 1 for n in new},
        finished_req_ids=set(finished),
        preempted_req_ids=set(),
    )


@pytest.fixture
def scheduler_with_worker(tmp_path):
    """A SchedulerSide whose lookups reach a real LookupServer over a real LMCacheEngine that
    holds 256 tokens of PROMPTS["p300"] (stored without a connector: lookups only)."""
    config = LMCacheConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    md = LMCacheMetadata("m", 1, 0, 0, 1, torch.float32, 2, 2, 8, 8, chunk_size=CHUNK)
    engine = LMCacheEngine(config, md)
    tokens = PROMPTS["p300"]
    for key in engine._plan(tokens, None, None, "").keys[:4]:
        lease = engine.tier.allocate((2, CHUNK, md.kv_width), torch.float32)
        engine.tier.put(key, lease, None)
        lease.release()
    vc = _vllm_config(tmp_path)

    def lookup(query):
        with engine.lookup_and_lease(query.tokens, salt=query.salt) as hit:
            return hit.num_tokens

    server = LookupServer(engine_key(vc), 0, lookup, engine.clear)
    side = SchedulerSide(vc, config, world_size=1, local_world_size=1)
    yield side
    side.close()
    server.close()
    engine.close()


def _without_tokens(req: Request) -> Request:
    req.prompt_token_ids = None  # vLLM's constructor refuses it; a corrupted object must not
    return req


HOSTILE = {
    "huge salt": lambda: _request("h1", PROMPTS["p300"], salt="s" * 100_000),
    "empty prompt": lambda: _request("h2", []),
    "token -1": lambda: _request("h3", [-1, *PROMPTS["p300"][1:]]),
    "token 2**40": lambda: _request("h4", [2**40] * 300),
    "10M tokens": lambda: _request("h5", [1] * 10_000_000),
    "no tokens at all": lambda: _without_tokens(_request("h6", [1, 2, 3])),
    "non-str salt": lambda: _request("h7", PROMPTS["p300"], salt=12345),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_scheduler_entry_points_never_raise(scheduler_with_worker, name):
    side = scheduler_with_worker
    req = HOSTILE[name]()
    need = side.get_num_new_matched_tokens(req, 0)
    assert isinstance(need, int) and need >= 0
    side.update_state_after_alloc(req, need)
    new = SimpleNamespace(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=([1, 2, 3],),
        num_computed_tokens=need,
    )
    side.build_connector_meta(_sched_out([new]))
    side.request_finished(req, [1, 2, 3])
    side.build_connector_meta(_sched_out(finished=[req.request_id]))
    # and the next ordinary request is served normally
    ok = _request(f"ok-{name}", PROMPTS["p300"])
    assert side.get_num_new_matched_tokens(ok, 0) == 256


def test_prompt_logprobs_requests_never_load_from_lmcache(scheduler_with_worker):
    """A request that asks for prompt logprobs (or sets ``skip_reading_prefix_cache``) needs
    every prompt token computed; vLLM 0.26 still asks the connector and would take its hit, so
    lmcache itself answers 0 for it, while an ordinary request with the same tokens hits."""
    side = scheduler_with_worker
    tokens = PROMPTS["p300"]
    logprobs = Request("lp", tokens, SamplingParams(max_tokens=4, prompt_logprobs=1), None)
    assert logprobs.skip_reading_prefix_cache
    assert side.get_num_new_matched_tokens(logprobs, 0) == 0
    forced = SamplingParams(max_tokens=4, skip_reading_prefix_cache=True)
    assert side.get_num_new_matched_tokens(Request("skip", tokens, forced, None), 0) == 0
    assert side.get_num_new_matched_tokens(_request("plain", tokens), 0) == 256


def test_malformed_scheduler_output_is_no_work(scheduler_with_worker):
    meta = scheduler_with_worker.build_connector_meta(SimpleNamespace(finished_req_ids=None))
    assert meta.requests == [] and scheduler_with_worker.stats["scheduler_failures"] == 1


def test_aborted_between_lookup_and_allocation(scheduler_with_worker):
    side = scheduler_with_worker
    req = _request("gone", PROMPTS["p300"])
    assert side.get_num_new_matched_tokens(req, 0) == 256
    side.request_finished(req, [])
    side.build_connector_meta(_sched_out(finished=["gone"]))
    assert "gone" not in side._load_specs and "gone" not in side._keys


def test_real_engine_keeps_serving(model_dir, baseline):
    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc()))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def gen(prompt):
        (out,) = llm.generate([prompt], sp, use_tqdm=False)
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    try:
        huge = {"prompt_token_ids": PROMPTS["p300"], "cache_salt": "t" * 50_000}
        assert gen(huge)[0] == baseline["p300"]
        llm.reset_prefix_cache()
        tokens, cached = gen(huge)  # the long salt is hashed, not refused: it hits its own KV
        assert tokens == baseline["p300"] and cached == 256
        llm.reset_prefix_cache()
        other = {"prompt_token_ids": PROMPTS["p300"], "cache_salt": "t" * 49_999 + "u"}
        assert gen(other) == (baseline["p300"], 0)  # another tenant: no hit
        # vLLM's own rejections reach the caller as before
        with pytest.raises(Exception, match="maximum context length"):
            gen({"prompt_token_ids": [5] * 2000})  # longer than max_model_len=1024
        with pytest.raises(Exception, match=r"out of vocabulary|vocab"):
            gen({"prompt_token_ids": [999_999] * 10})
        assert gen({"prompt_token_ids": PROMPTS["c200"]})[0] == baseline["c200"]
    finally:
        shutdown_engine(llm)
