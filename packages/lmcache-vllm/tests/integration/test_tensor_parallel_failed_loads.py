# SPDX-License-Identifier: Apache-2.0
"""Tensor parallel 2 on real vLLM 0.32 (CPU): a load that fails on rank 0 only.

Rank 1's load of the same request succeeds, but the KV it computes over the failure is wrong:
the next layer's input on every rank depends on rank 0's heads. Before the fix rank 1 stored
those chunks, and a later hit across both ranks loaded them and gave wrong tokens. Now every
rank marks what any rank's failed load spoiled (:mod:`lmcache_vllm.worker.rank_failures`).

The tiny Llama (2 KV heads: one per rank) stores ``p300`` (chunks 0-3). Rank 0's load of
``p300_ext`` then loses its lease while chunk ``BAD`` is damaged in rank 0's tier, so it fails
its checksum there; rank 1 loads all 4 chunks, and the step computes chunks 4 and 5.

- ``"fail"``: the request ends with an error; neither rank holds a chunk of ``p300_ext`` past
  what it loaded (rank 1 held chunks 4-5 before the fix).
- ``"recompute"``: its tokens are vLLM's alone; the recompute stores chunks ``BAD``-5 again.

Then ``p300`` and ``p300_ext`` run again until ``p300_ext`` hits all 6 chunks on both ranks; every
output is vLLM's alone, token for token. Each rank exchanged failures only in steps with loads.
In a subprocess (vLLM's workers are processes of their own; a worker extension reaches into them).
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

BAD = 3  # the damaged chunk on rank 0: tokens [192, 256), the last chunk p300 stores

EXTENSION = textwrap.dedent(
    """
    import torch

    def _worker():
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group()._impl.worker

    def _tier():
        from lmcache import tiers
        return next(iter(tiers.process_tier._tiers.values()))

    def _keys(tokens, chunk):
        from lmcache.keys import chunk_keys
        engine = _worker().lmcache_engine
        keys = chunk_keys(tokens, engine.metadata.fingerprint(), chunk, salt="\\0")
        return keys[: len(tokens) // chunk]

    class FaultExt:
        '''Methods vLLM mixes into each worker (``worker_extension_cls``).'''

        def lmc_arm(self, tokens, chunk, bad, fail_rank):
            '''On rank ``fail_rank`` only: the next load loses its lease while chunk ``bad``
            is damaged in this rank's tier, so it fails its checksum there (once).'''
            worker = _worker()
            if worker.rank != fail_rank:
                return False
            key = _keys(tokens, chunk)[bad]
            leases, tier = worker._leases, _tier()
            take = leases.take
            self.lmc_fired = []

            def faulty(req_id):
                held, looked = take(req_id)
                if self.lmc_fired or held is None:
                    return held, looked
                self.lmc_fired.append(req_id)
                held.release()
                with torch.inference_mode():
                    tier._entries[key].lease.tensor.view(-1).view(torch.uint8)[4321] ^= 0x20
                return None, None

            leases.take = faulty
            return True

        def lmc_state(self, tokens, chunk):
            worker = _worker()
            assert worker._saves.wait(timeout=60.0), "saves still running after 60 s"
            return {
                "rank": worker.rank,
                "stored": [_tier().contains(k) for k in _keys(tokens, chunk)],
                "fired": list(getattr(self, "lmc_fired", [])),
                "cut": worker._loads.failed.cut_saves,
                "remote_marks": worker._ranks.remote_marks,
                "exchanges": worker._ranks.exchanges,
            }
    """
)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        model, prompts, chunk, block, max_tokens, bad, policy = json.loads(sys.argv[1])
        llm = LLM(model=model, enforce_eager=True, block_size=block, dtype="float32",
                  max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                  tensor_parallel_size=2, distributed_executor_backend="mp",
                  worker_extension_cls="tp_faults.FaultExt",
                  kv_transfer_config={
                      "kv_connector": "LMCacheConnectorV1",
                      "kv_connector_module_path": "lmcache_vllm.connector",
                      "kv_role": "kv_both",
                      "kv_load_failure_policy": policy,
                      "kv_connector_extra_config": {
                          "lmcache.chunk_size": chunk, "lmcache.checksum": True,
                          "lmcache.max_local_cpu_size": 0.25}})
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ext = prompts["p300_ext"]
        out = {"runs": [], "states": []}

        def gen(name):
            assert llm.reset_prefix_cache()  # vLLM's own cache: hits come from lmcache
            (r,) = llm.generate([{"prompt_token_ids": prompts[name]}], sp, use_tqdm=False)
            done = r.outputs[0]
            out["runs"].append([name, list(done.token_ids), int(r.num_cached_tokens or 0),
                                done.finish_reason])
            out["states"].append(llm.collective_rpc("lmc_state", args=(ext, chunk)))

        gen("p300")
        out["armed"] = llm.collective_rpc("lmc_arm", args=(ext, chunk, bad, 0))
        gen("p300_ext")  # rank 0's load fails at chunk `bad`
        gen("p300")
        gen("p300_ext")
        gen("p300_ext")
        print("RESULT " + json.dumps(out), flush=True)

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_one_ranks_failed_load_is_stored_by_no_rank(model_dir, baseline, tmp_path, policy):
    (tmp_path / "tp_run.py").write_text(SCRIPT)
    (tmp_path / "tp_faults.py").write_text(EXTENSION)
    # The lookup sockets of this run only, in a short folder (AF_UNIX paths hold 107 bytes).
    private_tmp = tempfile.mkdtemp(prefix="lmc-tpf-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        TMPDIR=private_tmp,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
    )
    prompts = {k: PROMPTS[k] for k in ("p300", "p300_ext")}
    args = json.dumps([str(model_dir), prompts, CHUNK, BLOCK, MAX_TOKENS, BAD, policy])
    try:
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "tp_run.py"), args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    runs, states = out["runs"], out["states"]
    assert out["armed"] == [True, False]
    n = len(PROMPTS["p300_ext"]) // CHUNK  # 6 full chunks
    full = [True] * n

    # p300 stores chunks 0-3 on both ranks
    assert runs[0][1:] == [baseline["p300"], 0, "length"]
    assert [s["stored"] for s in states[0]] == [[True] * (BAD + 1) + [False] * (n - BAD - 1)] * 2

    # p300_ext: rank 0's load failed, rank 1's did not
    _, tokens, cached, reason = runs[1]
    r0, r1 = states[1]
    assert len(r0["fired"]) == 1 and r1["fired"] == [], (r0, r1)
    if policy == "fail":
        assert (cached, reason) == (0, "error"), runs[1]
    else:  # recomputed from the damaged chunk on: vLLM's tokens
        assert (tokens, reason) == (baseline["p300_ext"], "length"), runs[1][2:]

    # later hits across both ranks: vLLM's tokens, token for token (before the fix the last
    # ones loaded rank 1's chunks 4-5, computed over rank 0's failed load)
    hits = [BAD * CHUNK, (BAD + 1) * CHUNK, n * CHUNK] if policy == "fail" else [256, 384, 384]
    outcome = [
        (name, cached, tokens == baseline[name], reason)
        for name, tokens, cached, reason in runs[2:]
    ]
    assert outcome == [
        (name, hit, True, "length")
        for name, hit in zip(["p300", "p300_ext", "p300_ext"], hits, strict=True)
    ]
    assert [s["stored"] for s in states[-1]] == [full, full]

    # neither rank stored a chunk computed over the failure: rank 1 learnt of rank 0's failure
    # and cut its save of them too
    if policy == "fail":  # rank 0 dropped the damaged chunk; rank 1 keeps what it loaded
        assert r0["stored"] == [True] * BAD + [False] * (n - BAD), r0
        assert r1["stored"] == [True] * (BAD + 1) + [False] * (n - BAD - 1), r1
    else:  # the recompute stored chunks BAD-5 again
        assert r0["stored"] == r1["stored"] == full, (r0, r1)
    assert r1["remote_marks"] >= 1 and r1["cut"] > states[0][1]["cut"], (r0, r1)
    assert r0["remote_marks"] == 0 and r0["cut"] > states[0][0]["cut"], (r0, r1)

    # failures were exchanged in steps with loads only (one per run that loaded), on both ranks
    assert [s["exchanges"] for s in states[-1]] == [4, 4]
