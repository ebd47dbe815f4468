# SPDX-License-Identifier: Apache-2.0
"""Paths SGLang's ``--enable-lmcache`` hook imports (``lmcache.integration.sglang.*``).

They will forward to the ``lmcache-sglang`` adapter once it exists; today that adapter is a
skeleton, so importing the submodules SGLang names raises ``ImportError`` with the install hint and
SGLang falls back to running without lmcache.
"""
