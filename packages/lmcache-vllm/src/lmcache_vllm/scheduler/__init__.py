# SPDX-License-Identifier: Apache-2.0
"""The scheduler side of the connector: what to load and save for each request.

It runs in vLLM's engine-core process, on the scheduler's thread.
Lookups that may read a disk or remote tier run on a small thread pool of their own.
:mod:`~lmcache_vllm.scheduler.side` holds ``SchedulerSide``, the object vLLM's scheduler calls.
:mod:`~lmcache_vllm.scheduler.guard` turns each failure in it into a miss, counted and logged once.
:mod:`~lmcache_vllm.scheduler.request_keys` says what of a request, besides its tokens, enters
the chunk keys.
The lookup client (:mod:`~lmcache_vllm.scheduler.lookup_client`) asks every worker rank how many
leading tokens lmcache holds.
It remembers the lookups it sent whole (:mod:`~lmcache_vllm.scheduler.sent_lookups`), so a
lookup that vLLM asks again for a waiting request crosses the socket in a few bytes.
With several KV cache groups every hit is loaded asynchronously
(:mod:`~lmcache_vllm.scheduler.async_loads`): vLLM hears of a failed load per request.
Nothing here touches the KV cache, and nothing here may raise into vLLM.
"""
