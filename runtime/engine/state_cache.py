"""The prefix cache: whole states keyed by the exact token prefix they follow, bounded in bytes.

A Mamba state is small and of fixed size, so it is cached whole: the state after a prompt, at its chunk boundaries,
and after a finished completion. A prompt that extends a cached prefix (a chat turn, a shared few-shot header)
starts from that state and prefills only its new tokens.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np


class StateCache:
    """LRU of states keyed by the exact token prefix they follow, bounded in bytes.

    An entry holds what continuing needs: the states after the prefix and the logits of its last token. Entries live
    in storage made once (``make_rows``: the pool's :meth:`~SlotPool.cache_rows`, where the states copy fastest:
    device memory on CUDA, so that caching a state never crosses PCIe; a served request caches up to three), one
    row per entry. Memory is taken at the start, the whole budget. Logits the engine already holds on the host as
    an array of their own (a prompt's, taken from its prefill launch) are kept by reference instead of copied into
    the row (:meth:`put`): an iteration that admits 16 prompts of two chunks caches 32 entries, and their 32 host
    copies of 0.2 MB were most of the state cache's cost in it; such arrays are never written again, by the engine
    or the cache, and take host memory beyond the budget (one logits array an entry at most).
    """

    def __init__(
        self,
        max_bytes: int,
        shapes: tuple[tuple[int, ...], ...] = (),
        make_rows: Callable[[int, tuple[tuple[int, ...], ...]], list] | None = None,
    ) -> None:
        """``shapes``: of an entry's arrays (float32): conv [L, E, K-1], ssm [L, E, N], logits [V];
        ``make_rows(capacity, shapes)``: their storage, each indexable by entry (default: host arrays)."""
        self.max_bytes = max_bytes
        entry_bytes = 4 * sum(int(np.prod(shape)) for shape in shapes)
        self.capacity = max_bytes // entry_bytes if entry_bytes else 0  # entries
        make_rows = make_rows or (lambda n, shapes: [np.empty((n, *shape), np.float32) for shape in shapes])
        self.rows = make_rows(self.capacity, shapes) if self.capacity else []
        self.entry_bytes = entry_bytes
        self.free = list(range(self.capacity))  # rows without an entry
        self.held: dict[int, np.ndarray] = {}  # row -> the logits its entry keeps by reference (not in the row)
        self.entries: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()  # key -> row
        self.lengths: collections.Counter[int] = collections.Counter()  # entries per key length: a lookup tries
        # each length once (a set of every key's length per lookup was a tenth of a busy engine thread)
        self.hits = 0

    @property
    def bytes(self) -> int:
        """Bytes the entries take."""
        return len(self.entries) * self.entry_bytes

    def put(self, tokens: list[int], fill: Callable[[tuple], np.ndarray | None]) -> None:
        """Remember the state after ``tokens``: ``fill(rows)`` writes the entry (its row of each array: conv, ssm,
        logits) and returns None, or writes the states only and returns the logits to keep by reference (an array
        nobody writes again); the least recently used entry is evicted when every row is taken."""
        key = tuple(tokens)
        if not self.capacity or not key:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if not self.free:
            old, row = self.entries.popitem(last=False)
            self._forget(old)
            self.held.pop(row, None)
            self.free.append(row)
        row = self.free.pop()
        try:
            kept = fill(tuple(a[row] for a in self.rows))
        except BaseException:
            self.free.append(row)
            raise
        if kept is not None:
            self.held[row] = kept
        self.entries[key] = row
        self.lengths[len(key)] += 1

    def _forget(self, key: tuple[int, ...]) -> None:
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]

    def longest_prefix(self, tokens: list[int]) -> tuple[int, tuple | None]:
        """(n, entry) for the longest cached prefix tokens[:n] (the whole prompt included); (0, None) if none. The
        entry is its rows (views), valid until the next ``put``: the caller copies them."""
        if not self.entries:
            return 0, None
        lengths = sorted((n for n in self.lengths if n <= len(tokens)), reverse=True)
        for n in lengths:
            row = self.entries.get(tuple(tokens[:n]))
            if row is not None:
                self.entries.move_to_end(tuple(tokens[:n]))
                self.hits += 1
                return n, self._entry(row)
        return 0, None

    def _entry(self, row: int) -> tuple:
        """Entry ``row``'s arrays (views of its rows; its logits where they are kept by reference)."""
        *states, logits = (a[row] for a in self.rows)
        return (*states, self.held.get(row, logits))
