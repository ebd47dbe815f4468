# SPDX-License-Identifier: Apache-2.0
"""Engine-facing import paths that serving engines hard-code (frozen API).

These modules are thin lazy shims: they forward to the adapter distributions
(``lmcache-vllm``, ``lmcache-sglang``) and raise an ``ImportError`` naming the package to install
when the adapter is absent, so engines' own ``except ImportError`` fallbacks keep working.
"""
