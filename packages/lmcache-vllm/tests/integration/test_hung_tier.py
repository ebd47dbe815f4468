# SPDX-License-Identifier: Apache-2.0
"""A hung tier never holds the engine, and an aborted request releases what it holds (real
vLLM on the CPU).

* **Hung disk.** A prompt is stored with a disk folder; a fresh engine indexes the folder, then
  the prompt's chunk files are replaced by FIFOs, so reading them blocks as on a hung network
  mount. The stored prompt and an unrelated one are sent together: the unrelated one finishes
  in its normal time (its lookup runs beside the stuck one), the stored one within the tier
  deadline plus a recompute, both with the output of vLLM without lmcache.
* **Aborts.** With the disk tier (asynchronous lookups) and every worker lookup slowed down on
  purpose, requests are aborted at each point of their life: added and stepped once (lookup in
  flight), after the lookup answered, while running after their load. Once no request runs,
  no chunk is leased beyond the tier's own reference, in process and, with tensor parallelism,
  over the lookup sockets.

Every FIFO is opened from the writing side in teardown (through a hard link that outlives the
engine's own replacement of the file), so no reader thread stays blocked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_vllm.testing import make_prompt

from .conftest import CHUNK, MAX_TOKENS, PROMPTS, engine_kwargs, ktc, live_engine, process_tier

pytestmark = pytest.mark.slow

DEADLINE = 3.0  # tier_timeout of the hung-disk engine: longer than any request here takes
SLACK = 1.5  # scheduling noise on a shared 2-core machine (< DEADLINE: a wait would show)


def _cfg(folder: Path, tier_timeout: float = 1.0) -> dict[str, Any]:
    return ktc(local_disk=str(folder), max_local_disk_size=0.5, tier_timeout=tier_timeout)


class Fifos:
    """Chunk files replaced by FIFOs. Each keeps a hard link in ``keep`` (the engine may
    unlink the chunk name when it stores the chunk again); :meth:`release` opens every one from
    the writing side, which unblocks its readers (they then fail, as after an I/O error)."""

    def __init__(self, keep: Path) -> None:
        self.keep = keep
        keep.mkdir()
        self.links: list[Path] = []

    def replace(self, path: Path) -> None:
        path.unlink()
        os.mkfifo(path, 0o600)
        link = self.keep / f"fifo{len(self.links)}"
        os.link(path, link)
        self.links.append(link)

    def release(self) -> None:
        for link in self.links:
            with contextlib.suppress(OSError):  # ENXIO: nobody reads it now
                os.close(os.open(link, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def fifos(tmp_path: Path) -> Iterator[Fifos]:
    f = Fifos(tmp_path / "keep")
    yield f
    f.release()


def _flush_lower() -> None:
    for lower in live_engine().lower_tiers:
        assert lower.flush(30)


def _leases_beyond_the_tiers() -> int:
    """Leases on CPU-tier chunks beyond the tier's own (a request's held hit, a load)."""
    _flush_lower()  # queued disk writes hold shares until written
    tier = process_tier()
    with tier.pool.lease_counts() as refs:
        return sum(refs(e.lease) - 1 for e in list(tier._entries.values()))


def _until_done(llm: Any, prompts: dict[str, list[int]], sp: Any) -> dict[str, Any]:
    """Add every prompt at once, step until all finish; per request id: output tokens, cached
    tokens and seconds from the start to its finish."""
    engine = llm.llm_engine
    start = time.monotonic()
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    done: dict[str, Any] = {}
    while len(done) < len(prompts):
        assert time.monotonic() - start < 300, f"only {sorted(done)} finished"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (
                    list(out.outputs[0].token_ids),
                    int(out.num_cached_tokens or 0),
                    time.monotonic() - start,
                )
    return done


def test_a_hung_disk_holds_up_no_request(model_dir, baseline, tmp_path, fifos):
    from vllm import LLM, SamplingParams

    from .conftest import shutdown_engine

    folder = tmp_path / "kv"
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=_cfg(folder)))
    try:
        llm.generate([{"prompt_token_ids": PROMPTS["p256"]}], sp, use_tqdm=False)
    finally:
        shutdown_engine(llm)  # flushes the disk writes
    stored = sorted(folder.rglob("*.lmc"))
    assert len(stored) == 4
    from lmcache.tiers import reset_process_cpu_tiers

    reset_process_cpu_tiers()  # as after a restart: the CPU tier is empty, the folder indexed

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=_cfg(folder, DEADLINE)))
    try:
        _until_done(llm, {"warm": make_prompt(200, 81, vocab_size=1000)}, sp)
        normal = _until_done(llm, {"normal": make_prompt(200, 82, vocab_size=1000)}, sp)
        normal_s = normal["normal"][2]
        for path in stored:
            fifos.replace(path)

        got = _until_done(llm, {"stored": PROMPTS["p256"], "unrelated": PROMPTS["c200"]}, sp)
        print(f"normal {normal_s:.2f} s; with a hung disk: {got}")  # shown with pytest -s

        tokens, cached, took = got["unrelated"]
        assert tokens == baseline["c200"] and cached == 0
        assert took < normal_s + SLACK, (took, normal_s)  # never waited for the stuck read
        tokens, cached, took = got["stored"]
        assert tokens == baseline["p256"]  # recomputed: the same output as without lmcache
        assert cached == 0
        assert DEADLINE * 0.9 <= took < DEADLINE + normal_s + SLACK, (took, normal_s)
        metrics = live_engine().metrics
        assert metrics.value("tier_timeouts") == 1
        assert live_engine().lower_tiers[0].guard.stuck == 1  # abandoned, not waited for
        fifos.release()
        assert _wait(lambda: live_engine().lower_tiers[0].guard.stuck == 0)
    finally:
        fifos.release()
        shutdown_engine(llm)


def _slow_lookups(delay_s: float) -> list[int]:
    """Every worker lookup of this process takes ``delay_s`` longer, after it leased its hit
    (a lookup still in flight when the request is aborted); returns ``[lookups started]``."""
    engine = live_engine()
    real = engine.lookup_and_lease
    started = [0]

    def slow(*args: Any, **kwargs: Any) -> Any:
        started[0] += 1
        hit = real(*args, **kwargs)
        time.sleep(delay_s)
        return hit

    engine.lookup_and_lease = slow  # type: ignore[method-assign]
    return started


def _abort_at_each_point(
    llm: Any, prompt: list[int], delay_s: float, started: list[int]
) -> list[int]:
    """Aborts at each point of a request's life (the socket test runs the same in its own
    process); the leases left beyond the tier's after each, once no request runs."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp_long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    left = []

    def settle() -> None:  # let late lookups land, and the finished ids reach the workers
        time.sleep(delay_s + 0.5)
        for _ in range(3):
            engine.step()

    for i in range(5):  # added, stepped once (its lookup asked for), aborted at once
        engine.add_request(f"asked{i}", {"prompt_token_ids": prompt}, sp_long)
        engine.step()
        engine.abort_request([f"asked{i}"])
        engine.step()
    settle()
    left.append(_leases_beyond_the_tiers())

    before = started[0]
    for i in range(5):  # added, stepped once (its lookup in the worker now), aborted
        engine.add_request(f"inflight{i}", {"prompt_token_ids": prompt}, sp_long)
        engine.step()
        assert _wait(lambda i=i: started[0] == before + i + 1)
        engine.abort_request([f"inflight{i}"])
        engine.step()
    # each lookup lands after its request ended: its hit is released at once
    assert _wait(lambda: _worker_side()._leases.late >= 5, 30), _worker_side()._leases.late
    settle()
    left.append(_leases_beyond_the_tiers())

    engine.add_request("answered", {"prompt_token_ids": prompt}, sp_long)
    engine.step()
    time.sleep(delay_s + 0.5)  # the lookup answered; vLLM has not asked again yet
    engine.abort_request(["answered"])
    settle()
    left.append(_leases_beyond_the_tiers())

    engine.add_request("running", {"prompt_token_ids": prompt}, sp_long)
    end = time.monotonic() + 120
    while True:  # until it loaded its hit and decodes
        outs = engine.step()
        if any(o.request_id == "running" and o.outputs[0].token_ids for o in outs):
            break
        assert time.monotonic() < end
    engine.abort_request(["running"])
    settle()
    left.append(_leases_beyond_the_tiers())
    return left


def test_aborts_at_each_point_leave_no_lease_in_process(model_dir, baseline, tmp_path):
    from vllm import LLM, SamplingParams

    from .conftest import shutdown_engine

    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=_cfg(tmp_path / "kv")))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": PROMPTS["p256"]}], sp, use_tqdm=False)
        assert llm.reset_prefix_cache()  # hits must come from lmcache
        started = _slow_lookups(0.5)
        assert _abort_at_each_point(llm, PROMPTS["p256"], 0.5, started) == [0, 0, 0, 0]
        # and a request that runs to its end after all that still loads its hit
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS["p256"]}], sp, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == baseline["p256"]
        assert out.num_cached_tokens == 224
        assert _leases_beyond_the_tiers() == 0
    finally:
        shutdown_engine(llm)


TP_ABORT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from vllm import LLM, SamplingParams

    def leases(worker):  # runs in each worker process (collective_rpc)
        from lmcache.tiers import process_tier
        for lower in process_tier._lower.values():
            lower.flush(30)
        total = 0
        for tier in process_tier._tiers.values():
            with tier.pool.lease_counts() as refs:
                total += sum(refs(e.lease) - 1 for e in list(tier._entries.values()))
        return total

    def late(worker):  # hits put by lookups of requests that had ended already
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group()._impl.worker._leases.late

    def slow_lookups(worker, delay_s):
        from lmcache_vllm.vllm_v1_adapter import live_engines
        engine = live_engines()[-1]
        real = engine.lookup_and_lease
        engine.slow_calls = 0
        def slow(*a, **k):
            engine.slow_calls += 1
            hit = real(*a, **k)
            time.sleep(delay_s)
            return hit
        engine.lookup_and_lease = slow
        return True

    def calls(worker):
        from lmcache_vllm.vllm_v1_adapter import live_engines
        return live_engines()[-1].slow_calls

    def main():
        model, prompt, chunk, block, folder = json.loads(sys.argv[1])
        llm = LLM(model=model, enforce_eager=True, block_size=block, dtype="float32",
                  max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                  tensor_parallel_size=2, distributed_executor_backend="mp",
                  kv_transfer_config={
                      "kv_connector": "LMCacheConnectorV1",
                      "kv_connector_module_path": "lmcache_vllm.connector",
                      "kv_role": "kv_both",
                      "kv_connector_extra_config": {
                          "lmcache.chunk_size": chunk, "lmcache.local_disk": folder,
                          "lmcache.max_local_disk_size": 0.5, "lmcache.tier_timeout": 1.0}})
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        assert llm.reset_prefix_cache()
        llm.collective_rpc(slow_lookups, args=(1.0,))
        engine = llm.llm_engine
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        # The engine core runs in its own process and steps by itself (stepping from here
        # would wait for an output): added, looked up by the core's scheduler, aborted while
        # its lookup is in flight.
        for i in range(5):
            engine.add_request(f"inflight{i}", {"prompt_token_ids": prompt}, long)
            time.sleep(0.3)
            engine.abort_request([f"inflight{i}"])
        end = time.monotonic() + 60  # until every lookup landed, after its request ended
        while time.monotonic() < end:
            time.sleep(0.5)
            started, landed = llm.collective_rpc(calls), llm.collective_rpc(late)
            if all(s >= 1 for s in started) and landed == started:
                break
        left = llm.collective_rpc(leases)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        print("RESULT " + json.dumps({"left": left, "cached": out.num_cached_tokens,
                                      "started": started, "late": landed,
                                      "after": llm.collective_rpc(leases)}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_aborts_leave_no_lease_over_the_lookup_sockets(model_dir, tmp_path):
    """Tensor parallel 2: each rank answers lookups on its own socket, in its own process."""
    script = tmp_path / "tp_abort.py"
    script.write_text(TP_ABORT_SCRIPT)
    private_tmp = tempfile.mkdtemp(prefix="lmc-tpa-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # collective_rpc of the script's functions
        TMPDIR=private_tmp,
    )
    args = json.dumps([str(model_dir), PROMPTS["p256"], CHUNK, 32, str(tmp_path / "kv")])
    proc = subprocess.Popen(
        [sys.executable, str(script), args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # on a timeout the engine's processes go with it
    )
    try:
        stdout, stderr = proc.communicate(timeout=500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["left"] == [0, 0], result
    # every lookup (one per rank and aborted request) landed after its request ended
    assert result["late"] == result["started"] and min(result["started"]) >= 1, result
    assert result["cached"] == 224 and result["after"] == [0, 0], result


def _worker_side() -> Any:
    """The worker side of the connector in this process (vLLM's worker-side connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._impl.worker


def _wait(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False
