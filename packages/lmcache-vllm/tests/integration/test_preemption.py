# SPDX-License-Identifier: Apache-2.0
"""Preemption on real vLLM (CPU): a KV cache too small for the batch makes vLLM preempt and
recompute requests while lmcache saves (prompt and decode tokens) and loads; every output equals
the same engine's without a connector."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import PROMPTS, engine_kwargs, ktc, make_prompt, shutdown_engine

PREEMPT_PROMPTS = [PROMPTS["p300"], PROMPTS["p300_ext"], make_prompt(280, 11), make_prompt(330, 12)]


def _run(model_dir: Any, kv: dict[str, Any] | None) -> tuple[list[list[list[int]]], dict[str, Any]]:
    from vllm import LLM, SamplingParams

    # 2 MiB of KV at 2 KiB per token (2 layers x 2 KV heads x 64 x K,V x fp32): ~1000 tokens for
    # four requests that grow to 1700 tokens together
    llm = LLM(
        **engine_kwargs(
            model_dir, kv_transfer_config=kv, kv_cache_memory_bytes=2 << 20, max_model_len=512
        )
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        rounds = []
        for _ in range(2):  # the second round hits what the first stored
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in PREEMPT_PROMPTS], sp, use_tqdm=False
            )
            rounds.append([list(o.outputs[0].token_ids) for o in outs])
            assert llm.reset_prefix_cache()
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        return rounds, metrics
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="module")
def without_connector(model_dir):
    return _run(model_dir, None)[0]


@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
def test_preempted_requests_keep_their_output(model_dir, without_connector, layerwise):
    base = without_connector
    got, metrics = _run(model_dir, ktc(save_decode_cache=True, use_layerwise=layerwise))
    assert metrics["vllm:num_preemptions"] > 0  # the scenario happened
    assert metrics["vllm:lmcache_loaded_tokens"] > 0
    assert metrics["vllm:lmcache_failed_load_tokens"] == 0
    assert got == base
