# SPDX-License-Identifier: Apache-2.0
"""The lazy forwarding behind the ``lmcache.integration.*`` shims.

Each shim is a module at a path an engine imports; it keeps its docstring and its ``__all__`` and
gets ``__getattr__``/``__dir__`` from :func:`forward_to`::

    __all__ = ["LMCacheConnectorV1Impl"]  # noqa: F822 - provided lazily by __getattr__

    __getattr__, __dir__ = forward_to("lmcache_vllm.vllm_v1_adapter", __all__)

Importing the shim imports nothing; the first attribute access imports the target module of the
adapter distribution. When that distribution is missing, the access raises ``ImportError`` with
the install command (so engines' own ``except ImportError`` fallbacks keep working); an
``ImportError`` from inside the adapter (a missing dependency of it) propagates as is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from lmcache._install_hint import adapter_install_command

__all__ = ["forward_to"]


def forward_to(
    target: str, names: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a shim module forwarding to ``target``.

    Args:
        target: The implementation module, in an adapter package named ``lmcache_<engine>``
            (e.g. ``"lmcache_sglang.mp_connector"``); imported at the first attribute access.
        names: The shim's ``__all__`` (what ``dir()`` lists). Any other public name is forwarded
            too; dunder names are not.

    Returns:
        ``__getattr__(name)``: the target's attribute ``name``. Raises ``AttributeError`` for a
        dunder name or one the target lacks, and ``ImportError`` naming the install command when
        the adapter package is missing. ``__dir__()``: ``sorted(names)``.
    """
    package = target.partition(".")[0]
    engine = package.removeprefix("lmcache_")
    if engine == package or not engine:
        raise ValueError(f"forward_to: {target!r} is not in an lmcache_<engine> package")
    hint = (
        f"lmcache.integration.{engine} requires the lmcache-{engine} adapter: "
        f"{adapter_install_command(engine)}"
    )

    def _target() -> ModuleType:
        try:
            return importlib.import_module(target)
        except ImportError as exc:
            if exc.name is not None and not exc.name.startswith(package):
                raise
            raise ImportError(f"{hint} (could not import {target}: {exc})") from exc

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(_target(), name)
        except AttributeError:
            raise AttributeError(f"{target} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
