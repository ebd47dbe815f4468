# SPDX-License-Identifier: Apache-2.0
"""A dense model's failed load on real vLLM 0.32 (CPU): nothing computed over it is stored.

A synchronous load that fails is reported to vLLM after the step
(``get_block_ids_with_load_errors``), but that step has already computed the request's later
tokens over the unfilled blocks. Before the fix their chunks were stored, and a later hit of the
prompt loaded that wrong KV and gave wrong tokens
(:mod:`lmcache_vllm.worker.failed_loads` says what no save may store now).

The tiny Llama stores ``p300`` (chunks 0-3). The load of ``p300_ext`` (6 full chunks) then
loses its lease while chunk ``BAD`` is damaged in lmcache's CPU tier, so the load reads the tier
and fails its checksum at chunk ``BAD``; the same step computes chunks 4 and 5. For batched and
layerwise saves, and either ``kv_load_failure_policy``:

- with ``"fail"`` it ends with an error and no chunk of ``p300_ext`` from ``BAD`` on is in the
  tier after it; ``p300`` stores chunk ``BAD`` again, then ``p300_ext`` hits chunks 0-3;
- with ``"recompute"`` its tokens are vLLM's alone, and the recompute (from chunk ``BAD``)
  stores chunks ``BAD``-5 again, so ``p300_ext`` later hits all 6 chunks;
- every later hit's tokens are vLLM's alone, token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from vllm import LLM, SamplingParams

from lmcache.keys import chunk_keys

from .conftest import CHUNK, MAX_TOKENS, PROMPTS, engine_kwargs, ktc, process_tier
from .conftest import shutdown_engine as _shutdown

pytestmark = pytest.mark.slow

BAD = 3  # the damaged chunk: tokens [192, 256), the last chunk p300 stores
CASES = [(kind, policy) for kind in ("batched", "layerwise") for policy in ("fail", "recompute")]


def _gen(llm: LLM, name: str) -> tuple[list[int], int, str | None]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[name]}], sp, use_tqdm=False)
    done = out.outputs[0]
    return list(done.token_ids), int(out.num_cached_tokens or 0), done.finish_reason


def _worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._impl.worker


def _eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _fail_next_load(worker: Any, key: bytes) -> list[str]:
    """The next load loses its lease while the chunk ``key`` is damaged in the CPU tier, so
    the load reads the tier and the chunk fails its checksum (once). Returns the requests hit."""
    tier = process_tier()
    leases = worker._leases
    take = leases.take
    fired: list[str] = []

    def faulty(req_id: str) -> tuple[Any, Any]:
        held, looked = take(req_id)
        if fired or held is None:
            return held, looked
        fired.append(req_id)
        held.release()  # the lease is lost: the load reads the tier, verified
        with torch.inference_mode():  # the pool's slabs were made in vLLM's inference mode
            tier._entries[key].lease.tensor.view(-1).view(torch.uint8)[4321] ^= 0x20
        return None, None

    leases.take = faulty
    return fired


def _settled(worker: Any) -> None:
    """Every save queued so far is committed (or dropped)."""
    assert worker._saves.wait(timeout=60.0), "saves still running after 60 s"


@pytest.mark.parametrize(("kind", "policy"), CASES)
def test_failed_load_stores_nothing_computed_over_it(model_dir, baseline, kind, policy):
    cfg = {
        **ktc(checksum=True, use_layerwise=kind == "layerwise"),
        "kv_load_failure_policy": policy,
    }
    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=cfg))
    try:
        assert _gen(llm, "p300") == (baseline["p300"], 0, "length")
        worker = _worker()
        engine = worker.lmcache_engine
        assert engine is not None and engine.config.use_layerwise == (kind == "layerwise")
        tier = process_tier()
        keys = chunk_keys(PROMPTS["p300_ext"], engine.metadata.fingerprint(), CHUNK, salt="\0")
        keys = keys[: len(PROMPTS["p300_ext"]) // CHUNK]  # full chunks: 0-5
        _eventually(lambda: all(tier.contains(k) for k in keys[: BAD + 1]), "p300 is stored")
        fired = _fail_next_load(worker, keys[BAD])
        cut = worker._loads.failed.cut_saves

        assert llm.reset_prefix_cache()
        tokens, cached, reason = _gen(llm, "p300_ext")
        assert fired, "the fault did not fire"
        if policy == "fail":
            assert reason == "error" and cached == 0, (tokens, cached, reason)
        else:  # recomputed from the damaged chunk on: vLLM's tokens
            assert (tokens, reason) == (baseline["p300_ext"], "length"), (cached, reason)
        _settled(worker)
        # the damaged chunk left the tier and the failed step stored nothing over it; with
        # "recompute" vLLM rolls the request back to the damaged chunk and the recompute
        # stores chunks BAD-5 again (the scheduler side counts them unsaved after a rollback)
        stored = [tier.contains(k) for k in keys]
        recomputed = policy == "recompute"
        expected = [True] * len(keys) if recomputed else [True] * BAD + [False] * (len(keys) - BAD)
        assert stored == expected, stored
        assert worker._loads.failed.cut_saves > cut, "no save was cut"

        assert llm.reset_prefix_cache()
        hit = (BAD + 1 if recomputed else BAD) * CHUNK
        assert _gen(llm, "p300") == (baseline["p300"], hit, "length")
        _settled(worker)
        _eventually(lambda: tier.contains(keys[BAD]), "p300 stores the damaged chunk again")

        assert llm.reset_prefix_cache()
        hit = (len(keys) if recomputed else BAD + 1) * CHUNK
        assert _gen(llm, "p300_ext") == (baseline["p300_ext"], hit, "length")
    finally:
        _shutdown(llm)
