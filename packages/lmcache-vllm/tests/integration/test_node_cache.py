# SPDX-License-Identifier: Apache-2.0
"""The node cache with real vLLM engines in separate processes (``node_cache: true``).

Three engine processes run at once against one node cache owner (a real ``python -m lmcache.node
serve``): B hits what A stored, with output identical to vLLM alone, also after A is SIGKILLed; C,
with another salt, hits nothing. When the owner is SIGKILLed the engines keep serving correctly
(as misses), and they hit again once a new owner runs. Each engine is a single-process vLLM driven line by line; every
generation empties vLLM's own prefix cache first, so a cached token can only come from lmcache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from lmcache.testing.node_owner import NodeOwner

from .conftest import BLOCK, CHUNK, MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    model, folder, salt, block, chunk, max_tokens = json.loads(sys.argv[1])
    llm = LLM(model=model, enforce_eager=True, block_size=block, dtype="float32",
              max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
              kv_transfer_config={
                  "kv_connector": "LMCacheConnectorV1",
                  "kv_connector_module_path": "lmcache_vllm.connector",
                  "kv_role": "kv_both",
                  "kv_connector_extra_config": {
                      "lmcache.chunk_size": chunk, "lmcache.max_local_cpu_size": 0.05,
                      "lmcache.node_cache": True, "lmcache.node_cache_dir": folder,
                      "lmcache.node_cache_autostart": False, "lmcache.cache_salt": salt}})
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    print("READY", flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        assert llm.reset_prefix_cache()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        print("RESULT " + json.dumps([list(out.outputs[0].token_ids),
                                      int(out.num_cached_tokens or 0)]), flush=True)
    """
)


class Engine:
    """A vLLM engine process with the node cache of ``folder`` and config salt ``salt``."""

    def __init__(self, script: Path, model_dir: Path, folder: Path, salt: str) -> None:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
        args = json.dumps([str(model_dir), str(folder), salt, BLOCK, CHUNK, MAX_TOKENS])
        self.log = script.parent / f"engine-{salt or 'nosalt'}-{time.time_ns()}.log"
        self._err = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(script), args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
            cwd=script.parent,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(f"engine exited ({self.proc.poll()}): {self.log.read_text()[-4000:]}")

    def gen(self, name: str) -> tuple[list[int], int]:
        """``(greedy tokens, tokens cached)`` of ``PROMPTS[name]``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(PROMPTS[name]) + "\n")
        self.proc.stdin.flush()
        tokens, cached = json.loads(self._expect("RESULT "))
        return tokens, cached

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()


def test_engine_processes_share_one_node_cache(model_dir: Path, baseline: Any, tmp_path: Path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    owner = NodeOwner(tmp_path / "node", 32 << 20, grace_s=2.0).start()
    engines: list[Engine] = []
    try:
        a = Engine(script, model_dir, owner.folder, "")
        engines.append(a)
        assert a.gen("p300") == (baseline["p300"], 0)  # cold: A stores 4 chunks
        b = Engine(script, model_dir, owner.folder, "")
        engines.append(b)
        assert b.gen("p300") == (baseline["p300"], 256)  # B hits what A stored
        c = Engine(script, model_dir, owner.folder, "tenant-c")
        engines.append(c)
        assert c.gen("p300") == (baseline["p300"], 0)  # another salt: nothing

        a.proc.kill()  # SIGKILL of the engine that stored the chunks: they stay
        assert b.gen("p300") == (baseline["p300"], 256)

        owner.kill()  # SIGKILL: the engines keep serving, as misses
        assert b.gen("p300") == (baseline["p300"], 0)
        assert c.gen("p300") == (baseline["p300"], 0)

        owner.start()  # a new, empty generation
        time.sleep(2.5)  # the clients' reconnect backoff is at most 2 s
        assert b.gen("p300") == (baseline["p300"], 0)  # stores again
        assert b.gen("p300") == (baseline["p300"], 256)  # and hits again
        assert c.gen("p300") == (baseline["p300"], 0)
    finally:
        for engine in engines:
            engine.close()
        owner.kill()
