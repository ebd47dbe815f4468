# SPDX-License-Identifier: Apache-2.0
"""The data path: copies between vLLM's paged KV cache and lmcache's chunk buffers.

These modules never import vLLM, and they hold no per-request state.
The worker's forward thread calls them for loads, and the save queue's copy thread for saves.
:mod:`~lmcache_vllm.transfer.paged_connector` holds the connector that lmcache's engine drives.
It picks one transfer strategy per cache: fused, CPU block or token by token.
"""
