# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding (vLLM's n-gram proposer) on real vLLM (CPU) with ``save_decode_cache``.

A step of a speculating request computes its last token and up to three draft tokens; vLLM
accepts or rejects the drafts only after the step. Every decode chunk must still be saved once
its tokens are accepted (never a rejected draft's KV): the next turn of the conversation then
loads exactly what the same run without speculative decoding loads, with identical output.

The speculating engine runs in a subprocess, in vLLM's default multiprocess mode: vLLM 0.32's
n-gram proposer imports numba, and once llvmlite is imported vLLM's CPU kernel overrides
(``register_triton_kernel_overrides``) fail for every later engine in that process
(``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from .conftest import BLOCK, CHUNK, engine_kwargs, ktc, make_prompt, shutdown_engine

pytestmark = pytest.mark.slow

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
TURN1_TOKENS = 184
# prompts of a 40-token phrase repeated (drafts are proposed from the start) and a tail: their
# decodes cross chunk boundaries with drafts in flight, and one (202 tokens) ends in a step whose
# accepted drafts complete the chunk [320, 384) (saved from the freed blocks after the request
# finished); none ends on a chunk boundary (there a run with drafts may also store the last
# output token's KV, which a run without computes only in the next turn)
LENGTHS = (197, 199, 201, 202, 203, 205)
TURN1 = [make_prompt(40, 300 + n) * (n // 40) + make_prompt(n % 40, 400 + n) for n in LENGTHS]
MORE = [make_prompt(40, 500 + n) for n in LENGTHS]
TURN2_TOKENS = 8

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        kwargs, turn1, more, n1, n2 = json.loads(sys.argv[1])
        llm = LLM(**kwargs)
        sp = SamplingParams(temperature=0.0, max_tokens=n1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in turn1], sp, use_tqdm=False)
        out1 = [list(o.outputs[0].token_ids) for o in outs]
        assert llm.reset_prefix_cache()  # vLLM's own cache: the next turn must use lmcache
        turn2 = [p + o + m for p, o, m in zip(turn1, out1, more)]
        sp = SamplingParams(temperature=0.0, max_tokens=n2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in turn2], sp, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        print("RESULT " + json.dumps({
            "out1": out1,
            "out2": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "metrics": metrics}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def _two_turns(llm: Any) -> dict[str, Any]:
    """Turn 1, vLLM's prefix cache reset, then turn 2 (turn 1 + its output + more tokens)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=TURN1_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in TURN1], sp, use_tqdm=False)
    out1 = [list(o.outputs[0].token_ids) for o in outs]
    assert llm.reset_prefix_cache()
    turn2 = [p + o + m for p, o, m in zip(TURN1, out1, MORE, strict=True)]
    sp = SamplingParams(temperature=0.0, max_tokens=TURN2_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in turn2], sp, use_tqdm=False)
    return {
        "out1": out1,
        "out2": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [int(o.num_cached_tokens or 0) for o in outs],
    }


def _in_process(model_dir: Any, kv: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=kv))
    try:
        return _two_turns(llm)
    finally:
        shutdown_engine(llm)


def _speculating(model_dir: Any, tmp_path: Any) -> dict[str, Any]:
    script = tmp_path / "spec_run.py"
    script.write_text(SCRIPT)
    kwargs = engine_kwargs(
        model_dir, kv_transfer_config=ktc(save_decode_cache=True), speculative_config=SPEC
    )
    kwargs["model"] = str(kwargs["model"])
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: engine core in a subprocess
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            json.dumps([kwargs, TURN1, MORE, TURN1_TOKENS, TURN2_TOKENS]),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def test_decode_chunks_saved_with_ngram_speculative_decoding(model_dir, tmp_path):
    reference = _in_process(model_dir, None)  # vLLM alone, no drafts
    plain = _in_process(model_dir, ktc(save_decode_cache=True))  # lmcache, no drafts
    spec = _speculating(model_dir, tmp_path)

    metrics = spec["metrics"]
    # the scenario happened: drafts were proposed, many accepted, some rejected
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < metrics["vllm:spec_decode_num_draft_tokens"]
    assert metrics["vllm:lmcache_failed_load_tokens"] == 0

    # every full chunk of the tokens whose KV turn 1 computed (its prompt and output but the
    # last token), on vLLM's block rule (less than the whole turn-2 prompt)
    expected = [
        min((n + TURN1_TOKENS - 1) // CHUNK * CHUNK, (n + TURN1_TOKENS + 40 - 1) // BLOCK * BLOCK)
        for n in LENGTHS
    ]
    assert reference["cached"] == [0] * len(LENGTHS)
    assert plain["cached"] == expected
    assert spec["cached"] == expected
    assert metrics["vllm:external_prefix_cache_hits"] == sum(expected)

    assert plain["out1"] == reference["out1"] and plain["out2"] == reference["out2"]
    assert spec["out1"] == reference["out1"] and spec["out2"] == reference["out2"]
