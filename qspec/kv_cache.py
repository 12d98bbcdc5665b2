"""The paged KV cache: one pool of pages per model, and each sequence's page table over it.

A page holds PAGE_SIZE positions of every layer's K and V: the pool is one array
[layers][2][pages · PAGE_SIZE][kv_heads][head_dim] (BF16 bits as uint16 for the native kernels,
float32 for the torch reference), and a sequence's position p lives in pool row
pages[p // PAGE_SIZE] · PAGE_SIZE + p % PAGE_SIZE (csrc/attention.h, KvCacheView). Target and MX
drafts share a sequence's pages (docs/architecture.md): the committed prefix is target-written,
draft passes write provisional rows after it, verify overwrites them; rejection = moving `length`
back. With `draft_copy` ("int8" or "int4"), a compact copy of every row (csrc/kv_q8.h) sits beside
the pool in the same layout; every native pass writes it with the BF16 row.

Prefix cache: a sequence records which token ids its leading rows hold as target rows (a row
depends only on the ids up to it, at one kernel path), and publishes its pages in the pool's
index under the ids they hold, keyed by everything before them. Another sequence whose prompt
starts with those ids adopts full pages by reference and copies the partial one it matches
(`adopt`): shared pages are never written (`writing` copies a shared page before a pass writes
into it, and takes an own page out of the index before changing its rows). Pages no sequence
holds stay in the index, least recently used first out, until a page is needed.

Draft trees (docs/architecture.md, "Tree attention") write nodes to slots after the committed
prefix; `move_rows` copies the accepted path's rows to their linear positions.
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np

from .config import ModelConfig
from .errors import ContextMemoryError
from .memory import DRAFT_COPY_BITS, PAGE_SIZE, Q8_BLOCK, check_fits, draft_copy_arrays, page_aligned_empty


class KVExhausted(Exception):
    """No free page and the pool may not grow (its page budget is spent): the caller preempts."""


class Preempted(Exception):
    """The sequence's pages were taken back for another sequence; it must start again."""


class KVPool:
    """Pages of K/V rows shared by every sequence of one model, and the prefix index over them.

    `max_pages`: the budget (None: grow while memory allows, ContextMemoryError when it does not).
    `lock` guards every change of pages and every pass over the pool (qspec/batch.py holds it while
    a batched forward runs, so no page moves under a running pass)."""

    def __init__(self, cfg: ModelConfig, dtype=np.uint16, draft_copy: str | None = None,
                 max_pages: int | None = None, page_size: int = PAGE_SIZE):
        if page_size <= 0 or page_size % 8:
            raise ValueError(f"page_size must be a positive multiple of 8, got {page_size}")
        if draft_copy not in (None, *DRAFT_COPY_BITS):
            raise ValueError(f"draft_copy must be None or one of {', '.join(DRAFT_COPY_BITS)}, got {draft_copy!r}")
        if draft_copy and (np.dtype(dtype) != np.uint16 or cfg.head_dim % Q8_BLOCK):
            raise ValueError(f"the draft copy needs BF16 rows and head_dim a multiple of {Q8_BLOCK}")
        if draft_copy == "int4" and (cfg.head_dim > 512 or 3 * cfg.head_dim % page_size):
            raise ValueError(f"the INT4 draft copy needs head_dim <= 512 and 3 x head_dim a multiple of the page "
                             f"size ({page_size})")
        self.draft_copy = draft_copy
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.page_size = page_size
        self.max_pages = max_pages
        self.lock = threading.RLock()
        shape = (cfg.n_layers, 2, 0, cfg.n_kv_heads, cfg.head_dim)
        self.data = page_aligned_empty(shape, self.dtype)
        # the draft copy (csrc/attention.h KvCacheView::q8k): K values, V values, their scales, flags
        self.q8 = tuple(page_aligned_empty(shape, t) for shape, t in draft_copy_arrays(cfg, draft_copy, 0, page_size)
                        ) if draft_copy else None
        self.refs = np.zeros(0, dtype=np.int32)  # sequences holding each page
        self._free: list[int] = []               # pages nobody holds and the index does not list
        # the prefix index: page -> (parent key, ids it holds); parent key -> its pages; and the
        # indexed pages nobody holds, least recently used first (evicted when a page is needed)
        self._entry: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self._children: dict[bytes, set[int]] = collections.defaultdict(set)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    # ---------------------------------------------------------------- pages
    @property
    def pages(self) -> int:
        return self.refs.size

    @property
    def bytes_per_position(self) -> int:
        """Bytes of one position (every layer, K and V, and its draft copy)."""
        return sum(int(np.prod(a.shape[:2]) * np.prod(a.shape[3:])) * a.itemsize for a in (self.data, *(self.q8 or ())))

    def free_pages(self) -> int:
        """Pages a sequence could get now without growing the pool (free + idle indexed ones)."""
        with self.lock:
            return len(self._free) + len(self._idle) + (
                max(0, self.max_pages - self.pages) if self.max_pages is not None else 1 << 40)

    def alloc(self) -> int:
        """A page for one sequence (reference count 1): a free one, else the least recently used
        idle indexed one, else a new one (the pool grows); KVExhausted past the budget."""
        with self.lock:
            if not self._free and not self._idle:
                self.grow()
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                self._unindex(page)
            self.refs[page] = 1
            return page

    def hold(self, page: int) -> None:
        with self.lock:
            if self.refs[page] == 0:
                self._idle.pop(page, None)
            self.refs[page] += 1

    def release(self, page: int) -> None:
        with self.lock:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self._entry:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def reserve(self, tokens: int) -> None:
        """Grow now to hold `tokens` positions (ContextMemoryError when they do not fit)."""
        with self.lock:
            self.grow_to(-(-tokens // self.page_size))

    def grow(self, n: int = 1) -> None:
        """Room for n more pages than are free (the caller holds the lock): the pool doubles, or
        grows by just what is missing when doubling does not fit in memory. KVExhausted past
        the budget; ContextMemoryError when even that does not fit."""
        need = self.pages + max(0, n - len(self._free) - len(self._idle))
        if need == self.pages:
            return  # the free and idle pages hold them
        if self.max_pages is not None and need > self.max_pages:
            raise KVExhausted(f"the KV cache's {self.max_pages} pages are all in use")
        target = max(need, 2 * self.pages, 16)
        if self.max_pages is not None:
            target = min(target, self.max_pages)
        try:
            self.grow_to(target)
        except ContextMemoryError:
            if target == need:
                raise
            self.grow_to(need)

    def grow_to(self, new: int) -> None:
        """At least `new` pages (the caller holds the lock), every row kept."""
        old = self.pages
        if new <= old:
            return
        rows = new * self.page_size
        check_fits(rows * self.bytes_per_position, f"a KV cache of {rows} tokens")

        def grown(a: np.ndarray) -> np.ndarray:
            g = page_aligned_empty((*a.shape[:2], rows, *a.shape[3:]), a.dtype)
            g[:, :, :a.shape[2]] = a
            return g

        self.data = grown(self.data)
        if self.q8 is not None:
            self.q8 = tuple(grown(a) for a in self.q8)
        self.refs = np.concatenate([self.refs, np.zeros(new - old, dtype=np.int32)])
        self._free.extend(range(new - 1, old - 1, -1))  # pop() takes the lowest first

    def copy_rows(self, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
        """Pool rows src -> dst, every layer, K and V and the draft copy."""
        for a in (self.data,) + (self.q8 or ()):
            a[:, :, dst_rows] = a[:, :, src_rows]

    # ---------------------------------------------------------------- prefix index
    @staticmethod
    def root_key(kernel_path: str | None) -> bytes:
        return hashlib.blake2b(f"kernel path {kernel_path}".encode(), digest_size=16).digest()

    @staticmethod
    def child_key(parent: bytes, ids: tuple[int, ...]) -> bytes:
        return hashlib.blake2b(parent + np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()

    def index(self, page: int, parent: bytes, ids: tuple[int, ...]) -> None:
        """List `page` as holding target rows of `ids` after the prefix keyed `parent`."""
        with self.lock:
            self._unindex(page)
            self._entry[page] = (parent, ids)
            self._children[parent].add(page)

    def _unindex(self, page: int) -> None:
        entry = self._entry.pop(page, None)
        if entry is not None:
            kids = self._children[entry[0]]
            kids.discard(page)
            if not kids:
                del self._children[entry[0]]

    def unindex(self, page: int) -> None:
        with self.lock:
            self._unindex(page)

    def indexed(self, page: int) -> bool:
        return page in self._entry

    def best_child(self, parent: bytes, ids: list[int]) -> tuple[int, int]:
        """(page, n): the indexed page after prefix `parent` whose ids share the longest start
        with `ids` (n of them); (-1, 0) when none does."""
        best, n_best = -1, 0
        for page in self._children.get(parent, ()):
            held = self._entry[page][1]
            n = 0
            for a, b in zip(held, ids):
                if a != b:
                    break
                n += 1
            if n > n_best:
                best, n_best = page, n
        return best, n_best

    def clear_index(self) -> None:
        """Forget every indexed prefix (the next prompts are prefilled in full)."""
        with self.lock:
            for page in list(self._entry):
                self._unindex(page)
            self._free.extend(self._idle)
            self._idle.clear()


class KVCache:
    """One sequence's cache: its page table over a pool, its committed `length`, and the record
    of which token ids its leading rows hold as target rows (for the prefix cache)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.pages: list[int] = []
        self._table: np.ndarray | None = None
        self.length = 0  # committed positions
        # rows [0, len(tokens)) hold the target's K/V of these token ids, computed at kernel path
        # `tokens_path`. A verify pass's rows for drafts that were then rejected stay valid target
        # rows of those ids (each row depends only on the ids up to it), so the record does not
        # follow `length`: it holds whatever the last target passes wrote.
        self.tokens: list[int] = []
        self.tokens_path: str | None = None
        self._indexed = 0  # leading pages listed in the pool's index (by us or adopted)
        self._adopted = 0  # leading pages adopted from the index (by reference)
        self.preempted = False
        # called (pool lock held) when a page is needed and the pool's budget is spent: frees
        # pages by preempting another sequence, or raises Preempted (qspec/batch.py); None: raise
        self.on_exhausted = None

    # ---------------------------------------------------------------- views
    @property
    def cfg(self) -> ModelConfig:
        return self.pool.cfg

    @property
    def data(self) -> np.ndarray:
        return self.pool.data

    @property
    def q8(self):
        return self.pool.q8

    @property
    def dtype(self) -> np.dtype:
        return self.pool.dtype

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    @property
    def bytes_per_position(self) -> int:
        return self.pool.bytes_per_position

    @property
    def page_table(self) -> np.ndarray:
        if self._table is None:
            self._table = np.asarray(self.pages, dtype=np.int32)
        return self._table

    def rows(self, start: int, end: int) -> np.ndarray:
        """Pool rows of positions start..end-1."""
        pos = np.arange(start, end)
        ps = self.pool.page_size
        return self.page_table[pos // ps].astype(np.int64) * ps + pos % ps

    # ---------------------------------------------------------------- pages
    def _check(self) -> None:
        if self.preempted:
            raise Preempted("the sequence was preempted")

    def _alloc(self) -> int:
        while True:
            try:
                return self.pool.alloc()
            except KVExhausted:
                if self.on_exhausted is None:
                    raise
                self.on_exhausted(self)
                self._check()

    def ensure_capacity(self, needed: int) -> None:
        """Pages for positions 0..needed-1 (rows already held are kept). KVExhausted when the
        pool's budget is spent; ContextMemoryError when growing it does not fit in memory."""
        with self.pool.lock:
            self._check()
            ps = self.pool.page_size
            missing = -(-needed // ps) - len(self.pages)
            if missing > 1:  # one growth for all of them when the pool has to grow
                try:
                    self.pool.grow(missing)
                except KVExhausted:
                    pass  # page by page, preempting as needed
            while len(self.pages) * ps < needed:
                self.pages.append(self._alloc())
                self._table = None

    def release(self) -> None:
        """Give every page back to the pool; indexed ones stay listed for later prompts. The
        leading part of a partial page the record covers is listed first."""
        with self.pool.lock:
            if not self.preempted:
                self._index_through(len(self.tokens), partial=True)
            for page in self.pages:
                self.pool.release(page)
            self.pages = []
            self._table = None
            self._indexed = self._adopted = 0
            self.length = 0
            self.tokens = []

    def preempt(self) -> None:
        """Take every page back now (another sequence needs them); the sequence's next use of the
        cache raises Preempted."""
        with self.pool.lock:
            self.preempted = True
            for page in self.pages:
                self.pool.release(page)
            self.pages = []
            self._table = None
            self.tokens = []
            self._indexed = self._adopted = 0

    def reset(self) -> None:
        self.length = 0

    def forget(self) -> None:
        """Drop every recorded prefix, this sequence's and the pool's: the next prompt is
        prefilled in full."""
        with self.pool.lock:
            for page in self.pages[:self._indexed]:
                self.pool.unindex(page)
            self._indexed = 0
            self.tokens = []
            self.pool.clear_index()

    # ---------------------------------------------------------------- prefix cache
    def adopt(self, ids: list[int], kernel_path: str | None) -> int:
        """Start this (empty) sequence with the longest indexed prefix of ids[:-1] (the last id is
        always run, for its logits): full pages by reference, the partial page it ends in as a
        copy. Returns how many positions it holds."""
        with self.pool.lock:
            self._check()
            if self.pages:
                raise ValueError("adopt: the sequence already holds pages")
            pool, ps = self.pool, self.pool.page_size
            limit = len(ids) - 1
            key, n = pool.root_key(kernel_path), 0
            while n < limit:
                page, m = pool.best_child(key, ids[n:min(n + ps, limit)])
                if m == 0:
                    break
                if m == ps:  # a full page: shared
                    pool.hold(page)
                    self.pages.append(page)
                    key = pool.child_key(key, tuple(ids[n:n + ps]))
                    n += ps
                    continue
                own = self._alloc()  # a partial match: copy its rows into a page of our own
                src = np.arange(page * ps, page * ps + m)
                pool.copy_rows(src, np.arange(own * ps, own * ps + m))
                self.pages.append(own)
                n += m
                break
            self._table = None
            self._indexed = self._adopted = n // ps
            self.tokens = [int(t) for t in ids[:n]]
            self.tokens_path = kernel_path
            self.length = n
            return n

    def _index_through(self, n_tokens: int, partial: bool = False) -> None:
        """List the pages the record covers in full (and, with `partial`, the covered start of the
        next one) in the pool's index."""
        pool, ps = self.pool, self.pool.page_size
        full = min(n_tokens // ps, len(self.pages))
        key = pool.root_key(self.tokens_path)
        for i in range(full):
            ids = tuple(self.tokens[i * ps:(i + 1) * ps])
            if i >= self._indexed and pool.refs[self.pages[i]] == 1:
                pool.index(self.pages[i], key, ids)
            key = pool.child_key(key, ids)
        self._indexed = max(self._indexed, full)
        if partial and full < len(self.pages) and n_tokens > full * ps and pool.refs[self.pages[full]] == 1:
            pool.index(self.pages[full], key, tuple(self.tokens[full * ps:n_tokens]))

    def writing(self, start_pos: int, end: int) -> None:
        """A pass is about to write positions start_pos..end-1 (every backend calls this before
        the pass): their pages are made ours to write (`_own`) and the record is cut at
        start_pos. `recorded` extends it once the pass has run."""
        with self.pool.lock:
            self._check()
            self._own(start_pos, end)
            del self.tokens[start_pos:]

    def recorded(self, start_pos: int, tokens, kernel_path: str | None) -> None:
        """A pass has written target rows of `tokens` from start_pos on (their bits depend only on
        the ids up to them, at `kernel_path`): the record takes them, and the pages it now covers
        in full are indexed for other prompts. Draft passes, tree passes and backends whose rows
        depend on the batch record nothing."""
        with self.pool.lock:
            if self.preempted or start_pos != len(self.tokens):
                return
            if kernel_path != self.tokens_path:
                self.tokens = []
                self.tokens_path = kernel_path
                if start_pos:
                    return
            self.tokens.extend(int(t) for t in tokens)
            self._index_through(len(self.tokens))

    def _own(self, start: int, end: int) -> None:
        """Make the pages of positions start..end-1 writable: a page another sequence holds or one
        it adopted from the index (rows other prompts may adopt) is replaced by a copy of our own;
        a page we indexed ourselves leaves the index (its rows are about to change)."""
        ps, pool = self.pool.page_size, self.pool
        first = start // ps
        for i in range(first, min(-(-end // ps), len(self.pages))):
            page = self.pages[i]
            if pool.refs[page] > 1 or (i < self._adopted and pool.indexed(page)):
                own = self._alloc()
                pool.copy_rows(np.arange(page * ps, page * ps + ps), np.arange(own * ps, own * ps + ps))
                pool.release(page)
                self.pages[i] = own
                self._table = None
            elif pool.indexed(page):
                pool.unindex(page)
        self._indexed = min(self._indexed, first)
        self._adopted = min(self._adopted, first)

    def move_rows(self, src_slots, dst_start: int, tokens=None, kernel_path: str | None = None) -> None:
        """Copies the K/V of every layer at `src_slots` (ascending, src_slots[j] >= dst_start + j)
        to rows dst_start, dst_start + 1, .. and sets `length` = dst_start + len(src_slots): the
        accepted path of a draft tree becomes linear, the rest of the tree is dropped.

        `tokens`: the ids of the moved rows when they are target rows (a tree verify pass; their
        bits equal a linear target pass's), recorded for prefix reuse like `writing` does, at
        `kernel_path`; None (draft rows): the record is cut at dst_start."""
        src = np.asarray(src_slots)
        if src.ndim != 1 or (src.size and src.dtype.kind not in "iu"):
            raise ValueError("move_rows: src_slots must be a 1-D sequence of ints")
        src = src.astype(np.int64)
        n = src.size
        if isinstance(dst_start, bool) or not isinstance(dst_start, (int, np.integer)) or dst_start < 0:
            raise ValueError(f"move_rows: dst_start must be an int >= 0, got {dst_start!r}")
        dst_start = int(dst_start)
        if n and (np.any(np.diff(src) <= 0) or np.any(src < dst_start + np.arange(n))):
            raise ValueError("move_rows: src_slots must be ascending with src_slots[j] >= dst_start + j")
        if tokens is not None and len(tokens) != n:
            raise ValueError(f"move_rows: {len(tokens)} tokens for {n} rows")
        with self.pool.lock:
            # preempted since the pass that wrote the rows (its pages went to an older sequence):
            # Preempted, as every other use of the cache raises, not a capacity error
            self._check()
            if dst_start + n > self.capacity or (n and src[-1] >= self.capacity):
                raise ValueError(f"move_rows: rows beyond the cache capacity {self.capacity}")
            self.writing(dst_start, dst_start + n)
            if n and not np.array_equal(src, dst_start + np.arange(n)):
                ps = self.pool.page_size
                table = self.page_table.astype(np.int64)
                self.pool.copy_rows(table[src // ps] * ps + src % ps, self.rows(dst_start, dst_start + n))
            if tokens is not None:
                self.recorded(dst_start, tokens, kernel_path)
            self.length = dst_start + n
