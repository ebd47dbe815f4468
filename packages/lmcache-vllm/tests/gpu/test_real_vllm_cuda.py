# SPDX-License-Identifier: Apache-2.0
"""Real vLLM on a CUDA GPU with lmcache: store, empty vLLM's prefix cache, hit; greedy output
identical to vLLM without lmcache.

Needs a CUDA GPU and a CUDA build of vLLM (skips with a reason otherwise; CI has neither). On an
offline GPU machine put an unpacked vLLM on ``PYTHONPATH`` first (the README's "Tests" section
says how). Each case starts engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a
tiny random Llama built at test time; vLLM's V1 and V2 GPU model runners and its FLASH_ATTN and
TRITON_ATTN backends are exercised, plus corrupted CPU-tier chunks (caught by the GPU
checksums, on by default), corrupted disk files (caught when read) and the disk tier (pinned
staging buffers, ``O_DIRECT`` reads).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU and vLLM's CUDA build", allow_module_level=True)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

from lmcache_vllm.testing import build_tiny_llama, make_prompt  # noqa: E402

CHUNK, BLOCK, MAX_TOKENS = 256, 16, 12
PROMPT = make_prompt(700, seed=7, vocab_size=1000)  # 2 full chunks + a 188-token tail
EXT = PROMPT + make_prompt(300, seed=8, vocab_size=1000)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("model") / "tiny-llama",
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=4096,
    )


def _llm(model_dir: Path, kv: dict[str, Any] | None, **extra: Any) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        enforce_eager=True,
        block_size=BLOCK,
        gpu_memory_utilization=0.05,  # ~7 GiB: a dozen engines start in one process
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        kv_transfer_config=kv,
    )
    backend = extra.pop("attention_backend", None)
    kwargs.update(extra)
    if backend is None:
        return LLM(**kwargs)
    try:  # the engine argument's name moved between vLLM versions
        return LLM(**kwargs, attention_backend=backend)
    except TypeError:
        return LLM(**kwargs, attention_config={"backend": backend})


def _shutdown(llm: Any) -> None:
    from lmcache_vllm.testing import shutdown_llm

    shutdown_llm(llm)


def _gen(llm: Any, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> dict[str, list[int]]:
    llm = _llm(model_dir, None, enable_prefix_caching=False)
    try:
        (p,), (e,) = _gen(llm, [PROMPT]), _gen(llm, [EXT])
        return {"prompt": p[0], "ext": e[0]}
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
def test_store_reset_hit_identical(model_dir, baseline, runner, layerwise, backend, monkeypatch):
    from lmcache.tiers import reset_process_cpu_tiers

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    reset_process_cpu_tiers()
    kv = {
        "kv_connector": "LMCacheConnectorV1",  # vLLM's in-tree name
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, "use_layerwise": layerwise},
    }
    llm = _llm(model_dir, kv, attention_backend=backend)
    try:
        chosen = llm.llm_engine.vllm_config.attention_config.backend
        assert chosen is not None and backend in str(chosen), chosen
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 0)]
        assert llm.reset_prefix_cache()
        # full chunks (512 tokens) come back from lmcache; vLLM computes the tail
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 512)]
        assert llm.reset_prefix_cache()
        # a prompt extending the stored one, batched with it: partial hit + full hit
        got = _gen(llm, [EXT, PROMPT])
        assert got[0][0] == baseline["ext"] and got[1][0] == baseline["prompt"]
        # each from lmcache (512) or from vLLM's own cache, holding the blocks of the other
        # when its lookup (in the background on CUDA) answered later (688 = 43 blocks)
        assert got[0][1] in (512, 688) and got[1][1] in (512, 688)
    finally:
        _shutdown(llm)
        reset_process_cpu_tiers()


def _live() -> Any:
    """The lmcache engine of the one vLLM engine alive in this process."""
    from lmcache_vllm.vllm_v1_adapter import live_engines

    return live_engines()[-1]


def _keys(engine: Any) -> list[bytes]:
    """The keys of PROMPT's two full chunks (no cache salt)."""
    from lmcache.keys import chunk_keys

    return chunk_keys(PROMPT, engine.metadata.fingerprint(), CHUNK, salt="\0")[:2]


def _wait(check: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():  # saves commit, and disk writes land, after the request returned
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _hit(llm: Any) -> list[tuple[list[int], int]]:
    """PROMPT after emptying vLLM's prefix cache: what it finds comes from lmcache."""
    assert llm.reset_prefix_cache()
    return _gen(llm, [PROMPT])


def _failed_loads(llm: Any) -> float:
    names = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return float(names.get("vllm:lmcache_failed_load_tokens", 0) or 0)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
def test_corrupted_chunk_is_recomputed(model_dir, baseline, layerwise, runner, monkeypatch):
    """Default settings: the store sums each chunk on the GPU, the lookup verifies the hit there.

    A bit flipped in a stored chunk's host bytes, then the chunk overwritten with another
    chunk's bytes, is caught on the device right after the lookup, before vLLM is promised the
    tokens, for the batched and the layerwise load: the hit ends before the bad chunk, vLLM
    computes the rest (no failed load), the output equals vLLM's alone, the bad chunk leaves the
    tier, and the recompute stores it again (the next hit is whole).
    """
    from lmcache.tiers import reset_process_cpu_tiers

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    reset_process_cpu_tiers()
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, "use_layerwise": layerwise},
    }
    llm = _llm(model_dir, kv, disable_log_stats=False)
    try:
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 0)]
        engine = _live()
        tier, keys = engine.tier, _keys(engine)
        for damage in ("flipped_bit", "other_chunk", None):
            _wait(lambda: all(tier.contains(k) for k in keys), "both chunks are stored")
            assert _hit(llm) == [(baseline["prompt"], 2 * CHUNK)]  # intact: both chunks hit
            if damage is None:
                break
            entries = [tier._entries[k] for k in keys]
            assert all(e.lease.checksum is not None and e.checksum is None for e in entries)
            a, b = (e.lease.tensor.view(-1).view(torch.uint8) for e in entries)
            with torch.inference_mode():
                if damage == "flipped_bit":
                    b[12345] ^= 0x10
                else:
                    b.copy_(a)
            failures = engine.metrics.value("checksum_failures")
            assert _hit(llm) == [(baseline["prompt"], CHUNK)]  # chunk 0 only
            assert engine.metrics.value("checksum_failures") == failures + 1
            assert entries[1] not in tier._entries.values()  # the bad chunk was dropped
        assert _failed_loads(llm) == 0
    finally:
        _shutdown(llm)
        reset_process_cpu_tiers()


@pytest.mark.parametrize("local_cpu", [False, True], ids=["disk", "disk_promoted"])
def test_corrupted_disk_chunk_is_recomputed(model_dir, baseline, local_cpu, tmp_path):
    """A disk hit: ``local_cpu: false``, or promoted into a host tier emptied as by a restart.

    A bit flipped in a chunk file's payload, its payload replaced by another chunk's (the
    header's payload checksum catches both), or the whole file replaced by another chunk's (the
    header's key catches it) fails the read's verification: the hit ends before the chunk, the
    file is deleted, the output equals vLLM's alone, and the recompute writes the chunk again.
    """
    from lmcache.tiers import reset_process_cpu_tiers
    from lmcache.tiers.chunk_format import HEADER_BYTES, fingerprint_digest

    reset_process_cpu_tiers()
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.chunk_size": CHUNK,
            "lmcache.local_cpu": local_cpu,
            "lmcache.max_local_cpu_size": 1.0,
            "lmcache.local_disk": str(tmp_path / "kv"),
            "lmcache.max_local_disk_size": 1.0,
        },
    }
    llm = _llm(model_dir, kv, disable_log_stats=False)
    try:
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 0)]
        engine = _live()
        folder = tmp_path / "kv" / fingerprint_digest(engine.metadata.fingerprint()).hex()
        first, second = (folder / f"{k.hex()}.lmc" for k in _keys(engine))

        def from_disk() -> list[tuple[list[int], int]]:
            def written() -> bool:
                assert all(lower.flush(30) for lower in engine.lower_tiers)
                return first.exists() and second.exists()

            _wait(written, "both chunk files are written")
            engine.tier.clear()  # what a restart leaves (local_cpu false: empty already)
            return _hit(llm)

        for damage in ("flipped_bit", "other_payload", "other_file", None):
            assert from_disk() == [(baseline["prompt"], 2 * CHUNK)]  # intact: both chunks hit
            if damage is None:
                break
            data, other = second.read_bytes(), first.read_bytes()
            if damage == "flipped_bit":
                data = data[:-2] + bytes([data[-2] ^ 0x01]) + data[-1:]
            elif damage == "other_payload":
                data = data[:HEADER_BYTES] + other[HEADER_BYTES:]
            else:
                data = other
            second.write_bytes(data)
            failures = engine.metrics.value("checksum_failures")
            assert from_disk() == [(baseline["prompt"], CHUNK)]  # chunk 0 only
            assert engine.metrics.value("checksum_failures") == failures + 1
        assert _failed_loads(llm) == 0
    finally:
        _shutdown(llm)
        reset_process_cpu_tiers()


def test_disk_tier_restart_on_gpu(model_dir, baseline, tmp_path):
    """``local_cpu: false`` + disk: pinned staging buffers, O_DIRECT reads; a new engine (after
    the process tiers are reset, as in a restart) hits from the folder with identical output."""
    from lmcache.tiers import reset_process_cpu_tiers

    reset_process_cpu_tiers()
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.chunk_size": CHUNK,
            "lmcache.local_cpu": False,
            "lmcache.max_local_cpu_size": 1.0,
            "lmcache.local_disk": str(tmp_path / "kv"),
            "lmcache.max_local_disk_size": 1.0,
        },
    }
    llm = _llm(model_dir, kv)
    try:
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 0)]
    finally:
        _shutdown(llm)
        reset_process_cpu_tiers()
    assert len(list((tmp_path / "kv").rglob("*.lmc"))) == 2
    llm = _llm(model_dir, kv)
    try:
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 512)]
    finally:
        _shutdown(llm)
        reset_process_cpu_tiers()


@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
def test_blocks_freed_and_reused_at_once_are_saved_as_they_were(model_dir, baseline, layerwise):
    """vLLM frees a finished request's blocks at once; the next step writes them. With the save
    thread slowed (every queued copy sleeps 0.3 s first), prompt A finishes in its prefill step
    and prompt B, in the next step, can only run in A's freed blocks: A's stored chunks must
    still be A's KV (the step's fence orders B's writes after A's gather, on the device)."""
    from vllm import SamplingParams

    from lmcache.tiers import reset_process_cpu_tiers
    from lmcache_vllm.testing import slow_save_copies

    reset_process_cpu_tiers()
    other = make_prompt(800, seed=9, vocab_size=1000)  # 50 blocks; PROMPT takes 44
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, "use_layerwise": layerwise},
    }
    llm = _llm(model_dir, kv, num_gpu_blocks_override=52, max_model_len=816, max_num_seqs=1)
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        with slow_save_copies(0.3) as queues:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in (PROMPT, other)], one, use_tqdm=False
            )
            assert queues and all(q.wait(timeout=60) for q in queues)
        assert outs[0].outputs[0].token_ids[0] == baseline["prompt"][0]
        assert llm.reset_prefix_cache()
        assert _gen(llm, [PROMPT]) == [(baseline["prompt"], 512)]
    finally:
        _shutdown(llm)
        reset_process_cpu_tiers()


TP2_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams

def main():
    model, prompt, chunk, max_tokens = json.loads(sys.argv[1])
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
          "kv_connector_extra_config": {"lmcache.chunk_size": chunk}}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    p = [{"prompt_token_ids": prompt}]
    llm = LLM(model=model, enforce_eager=True, block_size=16, gpu_memory_utilization=0.2,
              dtype="bfloat16", max_model_len=2048, seed=0, tensor_parallel_size=2,
              kv_transfer_config=kv)
    (a,) = llm.generate(p, sp, use_tqdm=False)
    assert llm.reset_prefix_cache()
    (b,) = llm.generate(p, sp, use_tqdm=False)
    print("RESULT " + json.dumps({
        "cold": [list(a.outputs[0].token_ids), a.num_cached_tokens],
        "warm": [list(b.outputs[0].token_ids), b.num_cached_tokens]}), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensor_parallel_2_store_reset_hit(model_dir, tmp_path):
    """TP=2 (vLLM's multiprocess executor, one rank per GPU): each rank stores its shard, the
    scheduler's lookup takes the smallest hit over both ranks; the warm output equals the cold
    one, which TP=2 computed without any hit (TP=2 may round differently from one GPU)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "tp2.py"
    script.write_text(TP2_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    arg = json.dumps([str(model_dir), PROMPT, CHUNK, MAX_TOKENS])
    proc = subprocess.run(
        [sys.executable, str(script), arg],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["cold"][1] == 0
    assert result["warm"] == [result["cold"][0], 512]
