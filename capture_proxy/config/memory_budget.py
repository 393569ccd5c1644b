"""How many workers the memory allows, and how much each process's caches may hold.

A proxy process holds its own memory (the interpreter and libraries: about 95 MB resident at
start; where ``exact_tokens`` loads a local tokenizer (settings ``tokenizer``,
``model_families``), 450-530 MB: its vocabulary, and ``transformers`` imports ``torch`` where
it is installed; the viewer loads ``tokenizer`` too, on its first page showing token text, in
any prompt mode: ``Settings.loads_tokenizers``) and its caches, which fill as it
serves calls and are bounded (``proxy/cache_bounds.py``: recent records, parent-digest
indexes, message facts, request bodies, tool lists): at most ``FULL_CACHE_MB`` by default.
Each worker of ``serve --workers`` holds its own. A sidecar limited to 2 GB running one worker
per CPU of its node would be killed by the kernel once its caches filled.

So where the memory this process may use is known (``cgroups.usable_memory_bytes``: the
machine's, capped by a container's limit):

- ``default_workers``: at most one worker per twice its own memory (``BASE_MB``, or
  ``BASE_MB_TOKENIZER`` with a local tokenizer), never more than the CPUs, at least 1;
- ``default_cache_mb``: the caches of all workers together at most a quarter of the memory,
  and at most half of what the processes' own memory leaves (the workers', and with several
  the supervisor's; the rest: requests and answers in
  flight, SQLite's page cache, the store's caches, the allocator's slack), at most
  ``FULL_CACHE_MB`` a process, at least ``MIN_CACHE_MB``.

The caches are caches: a smaller bound costs reads of the store (CPU), never a wrong link or
a lost call. Settings ``workers`` and ``cache_memory_mb`` override both. Pure arithmetic.
"""

from __future__ import annotations

MIB = 1024 * 1024
#: the caches of one process at their full size (MB): recent records 512, parent-digest
#: indexes 448 (131,072 calls of about 3.5 KB), message facts 128, request bodies 128, tools 16
FULL_CACHE_MB = 1232
#: the least a process's caches get (MB)
MIN_CACHE_MB = 32
#: a process's own memory before its caches (MB; 95 MB resident measured at start, rounded up)
BASE_MB = 128
#: the same with a tokenizer loaded (MB; 450-530 MB resident measured in ``exact_tokens`` with
#: the scripted engine's Qwen tokenizer and ``torch`` installed)
BASE_MB_TOKENIZER = 512


def default_workers(cpus: int, memory_bytes: int | None, tokenizer: bool) -> int:
    """Workers for ``cpus`` usable CPUs in ``memory_bytes`` of memory (None: unknown): at most
    one per ``2 * BASE_MB`` (``BASE_MB_TOKENIZER`` if ``tokenizer``), at least 1."""
    if memory_bytes is None:
        return max(1, cpus)
    per_worker = 2 * (BASE_MB_TOKENIZER if tokenizer else BASE_MB) * MIB
    return max(1, min(cpus, memory_bytes // per_worker))


def default_cache_mb(memory_bytes: int | None, workers: int, tokenizer: bool = False) -> int:
    """MB each of ``workers`` processes' caches may hold in ``memory_bytes`` of memory (None:
    unknown, ``FULL_CACHE_MB``): a quarter of it shared, and at most half of what the
    processes' own memory leaves (each worker's ``BASE_MB``, ``BASE_MB_TOKENIZER`` if
    ``tokenizer``, and with several the supervisor's ``BASE_MB``: it holds the store's writer
    and no tokenizer); within ``MIN_CACHE_MB`` and ``FULL_CACHE_MB``."""
    if memory_bytes is None:
        return FULL_CACHE_MB
    workers = max(1, workers)
    memory_mb = memory_bytes // MIB
    left = memory_mb - (BASE_MB_TOKENIZER if tokenizer else BASE_MB) * workers
    left -= BASE_MB if workers > 1 else 0  # the supervisor
    share = min(memory_mb // 4 // workers, left // 2 // workers)
    return max(MIN_CACHE_MB, min(FULL_CACHE_MB, share))
