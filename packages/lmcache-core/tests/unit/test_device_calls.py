# SPDX-License-Identifier: Apache-2.0
"""No module reaches ``torch.cuda`` or ``torch.xpu`` except the device backends.

Connectors, adapters and core go through :mod:`lmcache.devices`; only the CUDA backend (and a
device package's backend module) may call the device runtime. Comments and docstrings do not
count: the check reads the syntax tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[3]
ALLOWED = {
    "lmcache-core/src/lmcache/devices/cuda.py",  # the CUDA backend
    "lmcache-xpu/src/lmcache_xpu/device.py",  # the XPU backend (issue 28)
}
DEVICE_MODULES = {"cuda", "xpu"}


def _calls(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in DEVICE_MODULES
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            found.append((node.lineno, f"torch.{node.attr}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[:2] in (["torch", m] for m in DEVICE_MODULES):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            submodule = len(parts) > 1 and parts[1] in DEVICE_MODULES
            imported = len(parts) == 1 and any(a.name in DEVICE_MODULES for a in node.names)
            if parts[0] == "torch" and (submodule or imported):
                found.append((node.lineno, f"from {node.module} import ..."))
    return found


def test_only_device_backends_call_the_device_runtime() -> None:
    sources = sorted(PACKAGES.glob("*/src/**/*.py"))
    assert len(sources) > 50, f"found only {len(sources)} modules under {PACKAGES}"
    offenders = []
    for path in sources:
        rel = path.relative_to(PACKAGES).as_posix()
        if rel in ALLOWED:
            continue
        for line, what in _calls(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{rel}:{line}: {what}")
    assert offenders == [], (
        "device runtime called outside lmcache.devices; use the connector's DeviceBackend "
        "(lmcache.devices.get_backend(device)) instead:\n" + "\n".join(offenders)
    )


def test_the_check_sees_calls_and_ignores_text() -> None:
    code = (
        '"""torch.cuda in a docstring."""\n'
        "import torch  # torch.cuda in a comment\n"
        "s = 'torch.xpu in a string'\n"
        "torch.cuda.synchronize()\n"
        "x = torch.xpu.is_available\n"
        "import torch.cuda\n"
        "from torch.cuda import Stream\n"
        "from torch import xpu\n"
    )
    assert sorted(line for line, _ in _calls(ast.parse(code))) == [4, 5, 6, 7, 8]
