# SPDX-License-Identifier: Apache-2.0
"""The worker's counters since its last report, added to from several threads."""

from __future__ import annotations

import threading

from lmcache_vllm.connector_metadata import WorkerStats

__all__ = ["WorkerCounters"]


class WorkerCounters:
    """:class:`WorkerStats` behind a lock.

    vLLM's forward thread counts loads, and the save queue's threads count saves.
    Hold :attr:`lock` while changing :attr:`stats`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = WorkerStats()

    def count_save(self, stored: int, seconds: float) -> None:
        """One save of ``stored`` tokens that took ``seconds`` from its plan to its commit."""
        with self.lock:
            self.stats.stored_tokens += stored
            self.stats.num_saves += 1
            self.stats.save_seconds += seconds
