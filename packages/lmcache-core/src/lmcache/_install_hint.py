# SPDX-License-Identifier: Apache-2.0
"""The install command that error messages name for a missing adapter package.

Our packages are installed from wheels built from a checkout, by path. A plain
``pip install lmcache-vllm`` would take LMCache's unrelated 0.6 wrapper from the package registry.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["adapter_install_command"]


def adapter_install_command(engine: str) -> str:
    """The README's install line for ``lmcache-<engine>``, run from a checkout after ``nox -s build``.

    Args:
        engine: The adapter's engine or device name, e.g. ``"vllm"``, ``"sglang"``, ``"xpu"``.
    """
    try:
        ours = version("lmcache-core")
    except PackageNotFoundError:
        ours = "0.1.0"
    return (
        f'pip install "./dist/lmcache_core-{ours}-py3-none-any.whl[{engine}]" '
        f"./dist/lmcache_{engine}-{ours}-py3-none-any.whl (the wheels `nox -s build` makes in an "
        "lmcache checkout; not `pip install lmcache-" + engine + "`, which the package registry "
        "may answer with an unrelated package)"
    )
