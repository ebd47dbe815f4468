# SPDX-License-Identifier: Apache-2.0
"""The vLLM side of ``test_cross_engine_node_cache.py``, run by vLLM's Python (not SGLang's).

``python cross_engine_vllm_child.py SPEC``: ``SPEC`` is JSON with ``model``, ``node`` (the node
cache folder), ``prompt`` (token ids), ``chunk``, ``max_tokens`` and ``salts`` (one request per
entry, ``null`` for none). It first runs the prompt on a vLLM without any connector (``alone``),
then builds a fresh vLLM with lmcache's connector on that node cache and runs one request per
salt, emptying vLLM's own prefix cache before each: a cached token can only come from lmcache.
The last stdout line is ``RESULT`` and JSON: ``alone`` (token ids) and ``requests``, each with its
``tokens``, ``cached`` (vLLM's ``num_cached_tokens``) and the change of lmcache's own counters.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

COUNTERS = ("hit_tokens", "loaded_chunks", "stored_chunks")


def counters() -> dict[str, float]:
    """lmcache's own counters, summed over this process's live engines."""
    from lmcache_vllm.vllm_v1_adapter import live_engines

    out = dict.fromkeys(COUNTERS, 0.0)
    for engine in live_engines():
        for name in COUNTERS:
            out[name] += float(engine.metrics.value(name))
    return out


def main() -> None:
    from vllm import LLM, SamplingParams

    from lmcache_vllm.testing import shutdown_llm, vllm_engine_kwargs

    spec = json.loads(sys.argv[1])
    prompt = spec["prompt"]
    # 1024 positions (the model has 2048), bfloat16 KV like SGLang's engine: chunks are raw bytes
    kwargs = vllm_engine_kwargs(spec["model"], max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)

    alone = LLM(**kwargs)
    (out,) = alone.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
    result: dict[str, Any] = {"alone": list(out.outputs[0].token_ids), "requests": []}
    shutdown_llm(alone)

    connector = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_connector_module_path": "lmcache_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.chunk_size": spec["chunk"],
            "lmcache.max_local_cpu_size": 0.25,
            "lmcache.node_cache": True,
            "lmcache.node_cache_dir": spec["node"],
            "lmcache.node_cache_autostart": False,
        },
    }
    llm = LLM(**kwargs, kv_transfer_config=connector)
    for salt in spec["salts"]:
        request: dict[str, Any] = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        assert llm.reset_prefix_cache()
        before = counters()
        (out,) = llm.generate([request], sampling, use_tqdm=False)
        after = counters()
        result["requests"].append(
            {
                "salt": salt,
                "tokens": list(out.outputs[0].token_ids),
                "cached": int(out.num_cached_tokens or 0),
                "lmcache": {name: after[name] - before[name] for name in COUNTERS},
            }
        )
    shutdown_llm(llm)  # its stores are committed to the node cache before the process exits
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
