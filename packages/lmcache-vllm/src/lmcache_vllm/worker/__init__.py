# SPDX-License-Identifier: Apache-2.0
"""The worker side of the connector: loads and saves of KV between vLLM's pages and lmcache.

It runs in every worker process, one per tensor-parallel rank.
vLLM's forward thread calls ``WorkerSide`` (:mod:`~lmcache_vllm.worker.side`) around each step.
With several KV cache groups it calls ``GroupedWorkerSide`` (:mod:`~lmcache_vllm.worker.grouped`),
which fans each hook out to one ``WorkerSide`` per attention group.
Mamba groups' states at chunk boundaries are stored and loaded by
:mod:`~lmcache_vllm.worker.mamba_states`.
There every load is asynchronous, and :mod:`~lmcache_vllm.worker.async_loads` tells vLLM the
outcome per request.
Loads are in :mod:`~lmcache_vllm.worker.loads`.
A load that fails marks what it spoiled (:mod:`~lmcache_vllm.worker.failed_loads`), and no save
stores that.
Batched saves are in :mod:`~lmcache_vllm.worker.batched_saves`, layerwise loads and saves in
:mod:`~lmcache_vllm.worker.layerwise_step`.
Saves are copied and committed on the save queue's two background threads.
The lookup server (:mod:`~lmcache_vllm.worker.lookup_server`) answers the scheduler's lookups
on daemon threads, one per connection.
Each answered lookup leases its chunks (:mod:`~lmcache_vllm.worker.lookup_leases`) until the
load that follows takes them.
"""
