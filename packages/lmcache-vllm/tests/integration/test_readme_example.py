# SPDX-License-Identifier: Apache-2.0
"""The README's vLLM example, verbatim, on real vLLM (CPU build) in its default multiprocess mode.

The script is cut out of the README's "## Using it with vLLM" section, written to a file and run
unchanged, as a user runs it, with the tiny local model as its argument and the hub offline. Its output must
show a warm hit and identical greedy output, and each vLLM process that built the connector
(engine core, worker) must have logged lmcache's one start-up line.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import vllm

README = Path(__file__).resolve().parents[4] / "README.md"

# "(EngineCore pid=12) INFO 12-04 17:14:21 [banner.py:135] lmcache 0.1.0 (...) serves vLLM ..."
START_LINE = re.compile(
    r"^(?:\((?P<proc>\w+) pid=(?P<pid>\d+)\) )?INFO .*?\] lmcache (?P<lmcache>\S+) "
    r"\(lmcache-core (?P<core>\S+), lmcache-vllm (?P<adapter>\S+)\) serves vLLM (?P<vllm>\S+) "
    r"on (?P<device>\S+): kernels: (?P<kernels>.+)$",
    re.MULTILINE,
)


def readme_example(readme: Path = README) -> str:
    """The first ```python block of the README's "## Using it with vLLM" section."""
    text = readme.read_text(encoding="utf-8")
    section = text.split("\n## Using it with vLLM\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_example_is_the_readmes_only_program() -> None:
    """Every complete program of the README (a ```python block with a ``__main__`` guard) is
    the one this module runs: a new one needs a test of its own."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    programs = [b for b in blocks if 'if __name__ == "__main__":' in b]
    assert programs == [readme_example()]


def test_readme_example_runs_as_written(model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(readme_example(), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # What a user's shell has: vLLM's default multiprocess mode, default log levels.
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "LMCACHE_LOG_LEVEL"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"README example failed ({proc.returncode}):\n{out[-6000:]}"
    assert "same output: True" in proc.stdout, out[-6000:]
    cached = re.search(r"cached tokens: cold (\d+), warm (\d+)", proc.stdout)
    assert cached is not None, out[-6000:]
    # cold: nothing stored yet; warm: at least one 256-token chunk came from lmcache
    assert int(cached.group(1)) == 0 and int(cached.group(2)) >= 256, cached.group(0)

    lines = list(START_LINE.finditer(out))
    assert lines, f"no lmcache start-up line in vLLM's log:\n{out[-6000:]}"
    pids = [m["pid"] for m in lines]
    assert len(set(pids)) == len(pids), f"more than one start-up line per process: {pids}"
    for m in lines:
        assert m["lmcache"] == m["core"] == importlib.metadata.version("lmcache-core"), m[0]
        assert m["adapter"] == importlib.metadata.version("lmcache-vllm"), m[0]
        assert m["vllm"] == vllm.__version__, m[0]
        assert m["device"] == "cpu", m[0]
        assert m["kernels"].endswith("(CPU path, no CUDA kernels)"), m[0]
    assert {m["proc"] for m in lines} >= {"EngineCore", "Worker"}, [m[0] for m in lines]
