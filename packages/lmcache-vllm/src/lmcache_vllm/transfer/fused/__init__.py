# SPDX-License-Identifier: Apache-2.0
"""The fused path of :class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector`.

It moves all layers of all chunks of a request at once, through one chunk-major device staging
buffer and copy-engine DMAs. It runs on whichever thread calls the connector: vLLM's worker
thread for loads, the save queue's copy thread for stores, a lookup thread for the device copy
and check of a hit.

- :mod:`~lmcache_vllm.transfer.fused.store`: a store's steps, in order.
- :mod:`~lmcache_vllm.transfer.fused.load`: a hit's steps, in order.
- :mod:`~lmcache_vllm.transfer.fused.kernels`: the one-launch gathers and scatters, with the sums
  that guard them.
- :mod:`~lmcache_vllm.transfer.fused.views`: the strided views and the host copies.
- :mod:`~lmcache_vllm.transfer.fused.plan`: where each chunk lies in staging, which copies move it.
- :mod:`~lmcache_vllm.transfer.fused.slot_indices`: the device indices of the strided path.
- :mod:`~lmcache_vllm.transfer.fused.transfer`: builds the parts and hands each call to its
  direction.
"""
