"""The prefix cache: whole states keyed by the exact token prefix they follow, bounded in bytes.

A Mamba state is small and of fixed size, so it is cached whole: the state after a prompt, at its chunk boundaries,
and after a finished completion. A prompt that extends a cached prefix (a chat turn, a shared few-shot header)
starts from that state and prefills only its new tokens.

A prefix is keyed by its length and a 128-bit BLAKE2b digest of its tokens (int32, little-endian), not by the tokens:
a key of a million-token prompt's tokens held ~8 MB, and a long prompt caches an entry at each chunk boundary.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

DIGEST_BYTES = 16


class Prefix(NamedTuple):
    """A token prefix as the cache keys it: its length and the digest of its tokens."""

    length: int
    digest: bytes


def token_bytes(tokens) -> bytes | memoryview:
    """Tokens as the bytes a prefix digest hashes (int32, little-endian)."""
    return memoryview(np.ascontiguousarray(tokens, dtype="<i4")).cast("B")


def prefix_of(tokens: Sequence[int] | np.ndarray) -> Prefix:
    """The key of the prefix ``tokens``."""
    return Prefix(len(tokens), hashlib.blake2b(token_bytes(tokens), digest_size=DIGEST_BYTES).digest())


class PrefixHasher:
    """The keys of a growing token sequence's prefixes, each token hashed once (a sequence's fed tokens)."""

    def __init__(self) -> None:
        self.hash = hashlib.blake2b(digest_size=DIGEST_BYTES)
        self.length = 0

    def key(self, more: Callable[[int, int], np.ndarray], length: int) -> Prefix:
        """The key of the first ``length`` tokens; ``more(a, b)`` gives tokens a..b-1 of the sequence (those not
        hashed yet: ``length`` never decreases)."""
        if length > self.length:
            self.hash.update(token_bytes(more(self.length, length)))
            self.length = length
        return Prefix(length, self.hash.copy().digest())


class StateCache:
    """LRU of states keyed by the exact token prefix they follow, bounded in bytes.

    An entry holds what continuing needs: the states after the prefix and the logits of its last token. Entries live
    in storage made once (``make_rows``: the pool's :meth:`~SlotPool.cache_rows`, where the states copy fastest:
    device memory on CUDA, so that caching a state never crosses PCIe; a served request caches up to three), one
    row per entry, logits included. Memory is taken at the start, the whole budget, and nothing beyond it: a long
    prompt caches an entry at each chunk boundary, and logits kept as arrays of their own beside the rows took up
    to a logits array per entry more (+33 MiB on the default model after a 100,000-token prompt, 0.4 GB for
    mamba-130m's vocabulary when every row holds one).
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
        self.entries: collections.OrderedDict[Prefix, int] = collections.OrderedDict()  # key -> row
        self.lengths: collections.Counter[int] = collections.Counter()  # entries per key length: a lookup tries
        # each length once (a set of every key's length per lookup was a tenth of a busy engine thread)
        self.hits = 0

    @property
    def bytes(self) -> int:
        """Bytes the entries take."""
        return len(self.entries) * self.entry_bytes

    def put(self, tokens: Sequence[int] | np.ndarray | Prefix, fill: Callable[[tuple], None]) -> None:
        """Remember the state after ``tokens`` (or the prefix of that key): ``fill(rows)`` writes the entry (its row
        of each array: conv, ssm, logits); the least recently used entry is evicted when every row is taken."""
        key = tokens if isinstance(tokens, Prefix) else prefix_of(tokens)
        if not self.capacity or not key.length:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if not self.free:
            old, row = self.entries.popitem(last=False)
            self._forget(old)
            self.free.append(row)
        row = self.free.pop()
        try:
            fill(tuple(a[row] for a in self.rows))
        except BaseException:
            self.free.append(row)
            raise
        self.entries[key] = row
        self.lengths[key.length] += 1

    def _forget(self, key: Prefix) -> None:
        self.lengths[key.length] -= 1
        if not self.lengths[key.length]:
            del self.lengths[key.length]

    def longest_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, tuple | None]:
        """(n, entry) for the longest cached prefix tokens[:n] (the whole prompt included); (0, None) if none. The
        entry is its rows (views), valid until the next ``put``: the caller copies them. The tokens are hashed once,
        each cached length's digest taken on the way."""
        if not self.entries:
            return 0, None
        lengths = sorted(n for n in self.lengths if n <= len(tokens))
        if not lengths:
            return 0, None
        data = token_bytes(tokens[: lengths[-1]])
        hasher, done, keys = hashlib.blake2b(digest_size=DIGEST_BYTES), 0, []
        for n in lengths:
            hasher.update(data[4 * done : 4 * n])
            done = n
            keys.append(Prefix(n, hasher.copy().digest()))
        for key in reversed(keys):
            row = self.entries.get(key)
            if row is not None:
                self.entries.move_to_end(key)
                self.hits += 1
                return key.length, tuple(a[row] for a in self.rows)
        return 0, None
