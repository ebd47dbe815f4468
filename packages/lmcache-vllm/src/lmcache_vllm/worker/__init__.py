# SPDX-License-Identifier: Apache-2.0
"""The worker side of the connector: loads and saves of KV between vLLM's pages and lmcache.

It runs in every worker process, one per tensor-parallel rank.
vLLM's forward thread calls ``WorkerSide`` (:mod:`~lmcache_vllm.worker.side`) around each step.
With several KV cache groups it calls ``GroupedWorkerSide`` (:mod:`~lmcache_vllm.worker.grouped`),
which fans each hook out to one ``WorkerSide`` per group.
Saves are copied and committed on the save queue's two background threads.
The lookup server (:mod:`~lmcache_vllm.worker.lookup_server`) answers the scheduler's lookups
on daemon threads, one per connection.
Each answered lookup leases its chunks (:mod:`~lmcache_vllm.worker.lookup_leases`) until the
load that follows takes them.
"""
