# SPDX-License-Identifier: Apache-2.0
"""Paths vLLM imports: ``lmcache.integration.vllm.vllm_v1_adapter`` (forwards to ``lmcache_vllm``)."""
