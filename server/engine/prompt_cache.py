"""The prompt cache beyond the sequences: which slot a job takes, and prefixes kept in host RAM.

A sequence's KV cells are the first cache: a job placed in a slot whose cells match its prompt
computes only the rest. There are only ``n_parallel`` sequences, so with more conversations than
that, each new one evicts another's cells. ``Placer`` keeps what eviction would lose: before
a slot's cells are cut, it copies the sequence's state (``llama_state_seq_get_data``) into
``HostCache``, a RAM store bounded in bytes, least recently used out, keyed by the tokens and
the tenant scope that computed them. A job whose prompt extends a saved prefix gets it restored
into its sequence (``llama_state_seq_set_data``) and decodes only the rest.

Where the C work happens: deciding is pure and runs in the engine task (``Placer.place``);
cutting cells is one fast C call done there too; copying state out or in (milliseconds per
thousand tokens) is queued as a ``Placement`` and run by ``Placer.prepare`` in the decode
thread, between decode steps, while the engine task waits (``Placer.settle`` then files what
was saved). A job released meanwhile is reaped as usual afterwards: its cells are freed.
"""

from __future__ import annotations

import collections
import logging
import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ffi
from server.engine import scheduler
from server.engine.choice import Choice, Slot
from server.engine.config import EngineStats

logger = logging.getLogger("llama_trio.engine.prompt_cache")

# The pages of a new entry are faulted in by the kernel in one go when it is mapped (Linux),
# not one fault per page while llama.cpp copies into it: 8 instead of 20 ms per 1k tokens here.
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

# Caches shorter than this are not worth a copy (a chat template's preamble is about 30).
MIN_SAVED_TOKENS = 64
# In a scope: one request's own, which no other shares (llama-server's cache_prompt false):
# its cells are never saved, nor found.
UNSHARED = "\x00unshared:"
# Nor is a restore for a shorter match (restoring costs the whole entry; a BOS alone matches).
MIN_RESTORED_TOKENS = 16


@dataclass(eq=False)
class Entry:
    """A saved sequence state. ``data`` is an anonymous memory map of its own, so that the
    memory goes back to the system the moment the entry goes (``close``), whatever its size;
    freed heap blocks of this size would stay in the process."""

    scope: str
    tokens: list[int]
    data: mmap.mmap | bytearray

    def close(self) -> None:
        """Idempotent."""
        if isinstance(self.data, mmap.mmap):
            self.data.close()
        self.data = bytearray()


class HostCache:
    """Saved sequence states in RAM, at most ``limit`` bytes, least recently used out.

    Owned by the engine task: only it calls these methods. No entry's tokens are a prefix of
    another entry's of the same scope (the longer one serves both), so each saved token is held
    once per conversation.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.bytes = 0
        self.evictions = 0  # entries dropped to make room

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def lookup(self, scope: str, prompt: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` in ``scope``, and that length."""
        best: Entry | None = None
        best_len = 0
        for entry in self._entries.values():
            if entry.scope == scope:
                n = scheduler.common_prefix(entry.tokens, prompt)
                if n > best_len:
                    best, best_len = entry, n
        return best, best_len

    def wants(self, scope: str, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` are worth saving: long enough, and not already held by an entry."""
        if not self.enabled or len(tokens) < MIN_SAVED_TOKENS or UNSHARED in scope:
            return False
        for entry in self._entries.values():
            if entry.scope == scope and scheduler.common_prefix(entry.tokens, tokens) == len(tokens):
                self.touch(entry)
                return False
        return True

    def touch(self, entry: Entry) -> None:
        if id(entry) in self._entries:
            self._entries.move_to_end(id(entry))

    def put(self, entry: Entry) -> bool:
        """File ``entry``; entries it extends go, then the least recently used until it fits.
        False (nothing changes) when it alone is over the limit."""
        if len(entry.data) > self.limit:
            entry.close()
            return False
        n = len(entry.tokens)
        for key, old in list(self._entries.items()):
            if old.scope == entry.scope and scheduler.common_prefix(old.tokens, entry.tokens) == len(old.tokens) <= n:
                self._drop(key)
        while self._entries and self.bytes + len(entry.data) > self.limit:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._entries[id(entry)] = entry
        self.bytes += len(entry.data)
        return True

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= len(entry.data)
        entry.close()

    def clear(self) -> None:
        """Drop every entry and free its memory. Idempotent."""
        for key in list(self._entries):
            self._drop(key)


@dataclass(eq=False)
class Placement:
    """C work a slot needs before its job's prompt is filled: save what it holds, then keep
    ``keep`` of its cells or restore ``restore`` and keep that much of it."""

    slot: Slot
    choice: Choice | None  # None: the slot goes to a copy (n > 1), which gets the source's cells
    keep: int
    save: Entry | None = None  # tokens and scope to save; ``data`` is filled by ``prepare``
    restore: Entry | None = None


class Placer:
    """Chooses slots for jobs and keeps their evicted caches in a ``HostCache``."""

    def __init__(self, context: ffi.Context, stats: EngineStats, cache_bytes: int) -> None:
        self._context = context
        self._stats = stats
        self.host = HostCache(cache_bytes)
        self.pending: list[Placement] = []

    def place(self, free: list[Slot], choice: Choice, scope: str) -> Slot:
        """Take the best of ``free`` for ``choice`` (removing it from the list) and set the
        choice's reused tokens. Work that needs the decode thread waits in ``pending``."""
        prompt = choice.prompt
        entry, saved = self.host.lookup(scope, prompt) if self.host.enabled else (None, 0)
        if saved < MIN_RESTORED_TOKENS:
            entry, saved = None, 0
        # Another scope's cache counts as held but never matches: it is only ever evicted.
        cached = [s.cached if s.scope == scope else () for s in free]
        held = [len(s.cached) for s in free]
        pick = scheduler.pick_slot(cached, held, [s.last_used for s in free], prompt, saved=saved)
        slot = free.pop(pick.index)
        if self.host.enabled and len(prompt) > MIN_SAVED_TOKENS:
            if pick.restore:
                self._stats.prompt_cache_hits += 1
            else:
                self._stats.prompt_cache_misses += 1
        self._evict(slot, pick.reuse, choice, entry if pick.restore else None)
        return slot

    def evict(self, slot: Slot) -> None:
        """``slot`` goes to a copy of another choice's cells: what it holds is saved first."""
        self._evict(slot, 0, None, None)

    def _evict(self, slot: Slot, keep: int, choice: Choice | None, restore: Entry | None) -> None:
        """``slot`` keeps its first ``keep`` cells, or ``keep`` of ``restore``'s; what is lost
        is saved when worth it."""
        save = None
        kept = 0 if restore is not None else keep
        if kept < len(slot.cached) and self.host.wants(slot.scope, slot.cached):
            save = Entry(slot.scope, list(slot.cached), bytearray())
        if save is None and restore is None:
            self._cut(slot, choice, keep)  # one fast C call
            return
        if restore is not None:
            self.host.touch(restore)
        self.pending.append(Placement(slot, choice, keep, save, restore))

    def prepare(self) -> None:
        """Run the pending placements' C work, and count it. Blocking: call it in the decode
        thread, while the engine task waits."""
        context, stats = self._context, self._stats
        for placement in self.pending:
            slot, restore, choice = placement.slot, placement.restore, placement.choice
            started = time.perf_counter()
            if placement.save is not None:
                self._save(slot, placement.save)
                stats.prompt_cache_save_seconds += time.perf_counter() - started
            if restore is None:
                self._cut(slot, choice, placement.keep)
                continue
            started = time.perf_counter()
            context.seq_rm(slot.seq_id)
            slot.cached.clear()
            if not context.seq_restore(restore.data, slot.seq_id):
                self._cut(slot, choice, 0)
                continue
            slot.cached.extend(restore.tokens)
            self._cut(slot, choice, placement.keep)
            stats.prompt_cache_restore_seconds += time.perf_counter() - started
            if choice is not None:
                choice.restored_tokens = choice.cached_tokens
                stats.prompt_cache_tokens_restored += choice.cached_tokens

    def _save(self, slot: Slot, entry: Entry) -> None:
        """Copy ``slot``'s state into ``entry`` (left empty when it does not fit the bound or
        cannot be copied: the cache is an optimisation)."""
        size = self._context.seq_state_size(slot.seq_id)
        if not 0 < size <= self.host.limit:
            return
        try:
            data = mmap.mmap(-1, size, flags=_MAP_FLAGS)
        except OSError as exc:
            logger.warning("no memory to save sequence %d's cache: %s", slot.seq_id, exc)
            return
        try:
            self._context.seq_save(slot.seq_id, data)
        except ffi.ContextError as exc:
            data.close()
            logger.warning("could not save sequence %d's cache: %s", slot.seq_id, exc)
            return
        entry.data = data

    def _cut(self, slot: Slot, choice: Choice | None, keep: int) -> None:
        """Keep the first ``keep`` cells of ``slot`` (all go when a partial cut fails) and start
        ``choice`` after them."""
        if keep < len(slot.cached) and not self._context.seq_rm(slot.seq_id, keep, -1):
            self._context.seq_rm(slot.seq_id)
            keep = 0
        del slot.cached[keep:]
        if choice is not None:
            choice.n_past = choice.n_prompt_done = choice.cached_tokens = keep
            self._stats.cached_tokens += keep

    def close(self) -> None:
        """Free every saved state, those of placements not yet settled too. Idempotent."""
        for placement in self.pending:
            if placement.save is not None:
                placement.save.close()
        self.pending.clear()
        self.host.clear()

    def settle(self) -> None:
        """After ``prepare``: file what was saved."""
        stats = self._stats
        for placement in self.pending:
            if placement.save is not None and len(placement.save.data) and self.host.put(placement.save):
                stats.prompt_cache_saves += 1
        self.pending.clear()
        stats.prompt_cache_bytes = self.host.bytes
        stats.prompt_cache_entries = len(self.host)
        stats.prompt_cache_evictions = self.host.evictions
