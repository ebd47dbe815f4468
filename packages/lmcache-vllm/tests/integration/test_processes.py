# SPDX-License-Identifier: Apache-2.0
"""vLLM's default multiprocess mode and the OpenAI server (each in a subprocess, ~1 min)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from .conftest import BLOCK, CHUNK, MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: engine core in a subprocess
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env


MP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        model, prompt, chunk, block, max_tokens = json.loads(sys.argv[1])
        llm = LLM(model=model, enforce_eager=True, block_size=block, dtype="float32",
                  max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                  kv_transfer_config={
                      "kv_connector": "LMCacheConnectorV1",
                      "kv_connector_module_path": "lmcache_vllm.connector",
                      "kv_role": "kv_both",
                      "kv_connector_extra_config": {"lmcache.chunk_size": chunk}})
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        p = [{"prompt_token_ids": prompt}]
        (a,) = llm.generate(p, sp, use_tqdm=False)
        assert llm.reset_prefix_cache()  # vLLM's own cache: the second run must use lmcache
        (b,) = llm.generate(p, sp, use_tqdm=False)
        print("RESULT " + json.dumps({
            "cold": [list(a.outputs[0].token_ids), a.num_cached_tokens],
            "warm": [list(b.outputs[0].token_ids), b.num_cached_tokens]}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_default_multiprocess_mode(model_dir, baseline, tmp_path):
    script = tmp_path / "mp_run.py"
    script.write_text(MP_SCRIPT)
    args = json.dumps([str(model_dir), PROMPTS["p300"], CHUNK, BLOCK, MAX_TOKENS])
    proc = subprocess.run(
        [sys.executable, str(script), args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["cold"] == [baseline["p300"], 0]
    assert result["warm"] == [baseline["p300"], 256]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_openai_server_with_in_tree_name(model_dir, baseline, tmp_path):
    port = _free_port()
    ktc = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--no-enable-prefix-caching",
        "--kv-transfer-config",
        ktc,
    ]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(LMCACHE_CHUNK_SIZE=str(CHUNK)),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-5000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(1)
        body = {
            "model": str(model_dir),
            "prompt": PROMPTS["p300"],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        first = _post(base + "/v1/completions", body)
        second = _post(base + "/v1/completions", body)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        token_ids = second["choices"][0].get("token_ids")
        assert token_ids is not None, second["choices"][0]  # return_token_ids was asked for
        assert list(token_ids) == baseline["p300"]
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        hits = [
            float(m.group(1))
            for m in re.finditer(
                r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M
            )
        ]
        assert sum(hits) == 256, [ln for ln in metrics.splitlines() if "prefix_cache" in ln]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
