# SPDX-License-Identifier: Apache-2.0
"""Tensor parallel 2 on real vLLM (CPU), end to end: every rank stores and loads its own shard.

vLLM runs one worker process per rank (``distributed_executor_backend="mp"``) with one core each
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``; without it vLLM stops with "Not enough allowed NUMA nodes to
bind threads of 2 local CPUWorkers"). Each worker holds one of the 2 KV heads, serves its own
lookup socket and stores into its own process's lmcache tier; the scheduler counts a token as
cached only when both ranks hold it. In a subprocess (~75 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from .conftest import BLOCK, CHUNK, MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

TP_SCRIPT = textwrap.dedent(
    """
    import glob, json, os, sys
    from vllm import LLM, SamplingParams

    def sockets():
        root = os.environ["TMPDIR"]
        found = glob.glob(os.path.join(root, "lmcache-vllm-*", "rank*.sock"))
        return sorted(os.path.relpath(p, root) for p in found)

    def main():
        model, prompt, chunk, block, max_tokens = json.loads(sys.argv[1])
        llm = LLM(model=model, enforce_eager=True, block_size=block, dtype="float32",
                  max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                  disable_log_stats=False,
                  tensor_parallel_size=2, distributed_executor_backend="mp",
                  kv_transfer_config={
                      "kv_connector": "LMCacheConnectorV1",
                      "kv_connector_module_path": "lmcache_vllm.connector",
                      "kv_role": "kv_both",
                      "kv_connector_extra_config": {"lmcache.chunk_size": chunk}})
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        p = [{"prompt_token_ids": prompt}]
        (a,) = llm.generate(p, sp, use_tqdm=False)
        live_sockets = sockets()
        assert llm.reset_prefix_cache()  # vLLM's own cache: the second run must use lmcache
        (b,) = llm.generate(p, sp, use_tqdm=False)
        metrics = {m.name: float(m.value) for m in llm.get_metrics()
                   if isinstance(getattr(m, "value", None), (int, float))}
        print("RESULT " + json.dumps({
            "cold": [list(a.outputs[0].token_ids), a.num_cached_tokens],
            "warm": [list(b.outputs[0].token_ids), b.num_cached_tokens],
            "sockets": live_sockets,
            "metrics": metrics}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_tensor_parallel_2_store_hit_identical_output(model_dir, baseline, tmp_path):
    script = tmp_path / "tp_run.py"
    script.write_text(TP_SCRIPT)
    # The lookup sockets of this run only, in a short folder (AF_UNIX paths hold 107 bytes).
    private_tmp = tempfile.mkdtemp(prefix="lmc-tp-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: engine core in a subprocess
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        TMPDIR=private_tmp,
    )
    args = json.dumps([str(model_dir), PROMPTS["p300"], CHUNK, BLOCK, MAX_TOKENS])
    try:
        proc = subprocess.run(
            [sys.executable, str(script), args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT ") :])

    # TP=2 (float32) decodes exactly like one rank; the warm run loaded 4 chunks on both ranks.
    assert result["cold"] == [baseline["p300"], 0]
    assert result["warm"] == [baseline["p300"], 256]

    # One lookup server per rank, in one engine folder, while the engine ran.
    folders = {s.split("/")[0] for s in result["sockets"]}
    assert len(folders) == 1, result["sockets"]
    assert [s.split("/")[1] for s in result["sockets"]] == ["rank0.sock", "rank1.sock"]

    m = result["metrics"]
    assert m["vllm:external_prefix_cache_hits"] == 256
    # Worker counters are summed over the ranks: each rank stored its 4 chunks (cold) and
    # loaded them back (warm) from its own tier; nothing failed.
    lm = {k: v for k, v in m.items() if k.startswith("vllm:lmcache_")}
    assert lm.get("vllm:lmcache_stored_tokens") == 2 * 256, lm
    assert lm.get("vllm:lmcache_loaded_tokens") == 2 * 256, lm
    assert lm.get("vllm:lmcache_failed_load_tokens", 0) == 0, lm
