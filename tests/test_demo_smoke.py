# SPDX-License-Identifier: Apache-2.0
"""The README's main job, small: benchmarks/vllm_demo.py --smoke on real vLLM (CPU).

Cross-package: the demo script, lmcache-core's shim (vLLM's in-tree connector name imports
``lmcache.integration.vllm.vllm_v1_adapter``) and lmcache-vllm together. The demo itself checks
that the warm run loaded KV from lmcache and produced the same greedy tokens as the cold run, and
exits non-zero otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_smoke_loads_from_lmcache_with_identical_output(tmp_path: Path) -> None:
    # A plain import, no importorskip: in ``nox -s vllm`` a missing or broken vLLM fails here.
    import vllm

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_demo.py"), "--smoke"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"vLLM {vllm.__version__}:\n{out[-4000:]}"
    lines = [line.strip() for line in out.splitlines()]
    same = next(line for line in lines if line.startswith("outputs identical:"))
    assert same.split(":", 1)[1].split()[0] == "yes", same
    loaded = next(line for line in lines if line.startswith("tokens loaded from lmcache:"))
    # "<hit> of <prompt> (... vLLM's own prefix cache served <n>)": the whole prompt is stored
    # (1024 tokens = 4 chunks of 256), so lmcache supplies all of it but the last block of 32
    # (vLLM computes the last token, and hits end on block boundaries as vLLM's own do);
    # vLLM's own cache (emptied before run 2) supplies none.
    hit, _, prompt = loaded.split(":", 1)[1].split()[:3]
    assert int(hit) == int(prompt) - 32, loaded
    assert loaded.rstrip(")").endswith("prefix cache served 0"), loaded
