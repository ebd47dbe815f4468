# SPDX-License-Identifier: Apache-2.0
"""The README's Python programs run as written on real vLLM (CPU), in vLLM's default mode.

Each ```python block of the root README that is a complete program (it has a
``if __name__ == "__main__":`` guard) is saved to a file and run with ``python``, the only change
being its ``MODEL = ...`` line, which names a tiny random model built here (no hub). vLLM's
default multiprocess mode is left on: that is what a user who copies the program gets.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_LINE = re.compile(r'^MODEL = ".*"(\s*#.*)?$', re.MULTILINE)


def readme_programs() -> list[str]:
    """The README's ```python blocks that are complete programs."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    return [b for b in blocks if 'if __name__ == "__main__":' in b]


def test_readme_has_a_complete_vllm_program() -> None:
    programs = readme_programs()
    assert programs, "README.md has no complete ```python program (with a __main__ guard)"
    for program in programs:
        assert len(MODEL_LINE.findall(program)) == 1, "each program sets MODEL = '...' once"


@pytest.mark.parametrize("index", range(len(readme_programs())))
def test_readme_program_runs_and_hits(index: int, tmp_path: Path) -> None:
    # A plain import, no importorskip: in ``nox -s vllm`` a missing or broken vLLM fails here.
    import vllm

    from lmcache_vllm.testing import build_tiny_llama

    model = build_tiny_llama(
        Path(tempfile.gettempdir()) / f"lmcache-readme-{os.getuid()}" / "tiny-llama",
        max_position_embeddings=8192,
    )
    program = MODEL_LINE.sub(f"MODEL = {str(model)!r}", readme_programs()[index])
    script = tmp_path / "example.py"
    script.write_text(program, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"vLLM {vllm.__version__}:\n{out[-4000:]}"
    cached = re.search(r"cached tokens: cold (\d+), warm (\d+)", proc.stdout)
    assert cached, proc.stdout[-2000:]
    assert int(cached.group(1)) == 0 and int(cached.group(2)) >= 256, cached.group(0)
    assert "same output: True" in proc.stdout, proc.stdout[-2000:]
