"""Prefix KV reuse: full pages of keys/values kept by the chained hash of the tokens before and in them.

A page is `block_size` tokens. Its key is hash(parent page's key, its tokens), and the first
page's parent is the tenant: identical prefixes of one tenant share entries, two tenants never
do. When a request is admitted the engine looks up its prompt page by page (the longest chain
present) and copies those pages into the request's own contiguous KV (one copy per layer, a
memory copy instead of a forward over those tokens), so turn N of a chat prefills only what is
new. After each prefill chunk, and when a request finishes, its full pages are stored. A request
admitted while another one prefills the same pages waits for them (engine.py) instead of
computing them a second time: requests that arrive together share their common prefix too.

The pool is a fixed number of pages per layer (allocated once, lazily mapped on a CPU); entries
are evicted least recently used. A running request copies what it matched at admission and never
holds an entry afterwards, so an entry is referenced only by the table: eviction is always
possible and never touches a running request (the contiguous storage is what makes the copy
cheap; a GPU paged-attention kernel would share the pages by reference instead).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from gpu_workers.kv_cache import KVBudget


def page_hashes(tokens: list[int], tenant: str, block_size: int, pages: int | None = None) -> list[bytes]:
    """Chained keys of the full pages of `tokens` (the first `pages` of them)."""
    n = len(tokens) // block_size if pages is None else min(pages, len(tokens) // block_size)
    parent = hashlib.blake2b(b"tenant:" + tenant.encode(), digest_size=16).digest()
    out = []
    for i in range(n):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.blake2b(
            parent + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=16
        ).digest()
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self, cache: KVBudget, num_pages: int) -> None:
        self.block_size = cache.block_size
        self.num_pages = num_pages
        size = num_pages * cache.block_size
        self.pool = [
            torch.empty(2, cache.kv_heads, size, cache.head_dim, dtype=cache.dtype, device=d)
            for d in cache.devices
        ]
        self.table: OrderedDict[bytes, int] = OrderedDict()  # key -> page, least recently used first
        self.free = list(range(num_pages - 1, -1, -1))
        self.hit_tokens = 0
        self.lookups = 0

    def clear(self) -> None:
        self.free = list(range(self.num_pages - 1, -1, -1))
        self.table.clear()
        self.hit_tokens = self.lookups = 0

    def _slots(self, pages: list[int], device) -> torch.Tensor:
        bs = self.block_size
        idx = torch.tensor(pages, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)
        return idx.reshape(-1).to(device)

    def cached(self, keys: list[bytes]) -> int:
        """How many of the leading `keys` are in the pool (a lookup that touches nothing)."""
        n = 0
        while n < len(keys) and keys[n] in self.table:
            n += 1
        return n

    def match(self, tokens: list[int], tenant: str, limit: int, keys: list[bytes] | None = None) -> list[int]:
        """Pages holding the longest cached prefix of `tokens`, at most `limit` tokens long.

        keys: the page keys of `tokens` when the caller has them already (`page_hashes`)."""
        self.lookups += 1
        pages = []
        n = limit // self.block_size
        for key in page_hashes(tokens, tenant, self.block_size, n) if keys is None else keys[:n]:
            page = self.table.get(key)
            if page is None:
                break
            self.table.move_to_end(key)
            pages.append(page)
        self.hit_tokens += len(pages) * self.block_size
        return pages

    def load(self, kv: list[torch.Tensor], pages: list[int]) -> int:
        """Copy `pages` into a request's storage from position 0; returns the tokens copied."""
        if not pages:
            return 0
        n = len(pages) * self.block_size
        for layer, pool in enumerate(self.pool):
            kv[layer][:, :, :n] = pool.index_select(2, self._slots(pages, pool.device))
        return n

    def store(
        self,
        kv: list[torch.Tensor],
        tokens: list[int],
        tenant: str,
        upto: int,
        keys: list[bytes] | None = None,
    ) -> int:
        """Keep the full pages of tokens[:upto] (their KV is in `kv`) that are not cached yet; returns
        the tokens written."""
        n = upto // self.block_size
        keys = page_hashes(tokens, tenant, self.block_size, n) if keys is None or len(keys) < n else keys[:n]
        new = [(i, k) for i, k in enumerate(keys) if k not in self.table][: self.num_pages]
        for k in keys:
            if k in self.table:
                self.table.move_to_end(k)
        if not new:
            return 0
        targets = []
        for _, key in new:
            if not self.free:
                _, evicted = self.table.popitem(last=False)
                self.free.append(evicted)
            page = self.free.pop()
            self.table[key] = page
            targets.append(page)
        for layer, pool in enumerate(self.pool):
            src = kv[layer].index_select(2, self._slots([i for i, _ in new], pool.device))
            pool.index_copy_(2, self._slots(targets, pool.device), src)
        return len(new) * self.block_size
