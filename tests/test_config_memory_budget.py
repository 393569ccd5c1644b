"""How many workers the memory allows and what each process's caches may hold
(``capture_proxy.config.memory_budget``, ``capture_proxy.proxy.cache_bounds``), and the
settings that carry them (``Settings.sizing``, ``Settings.cache_mb_for``) to the
linker's caches and to each worker of ``serve --workers``."""

from __future__ import annotations

import pytest

from capture_proxy.config import Settings
from capture_proxy.config import settings as settings_module
from capture_proxy.config.memory_budget import (
    FULL_CACHE_MB,
    MIN_CACHE_MB,
    default_cache_mb,
    default_workers,
)
from capture_proxy.core.known_bodies import KnownBodies
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.known_tools import KnownTools
from capture_proxy.proxy.cache_bounds import FULL_INDEX_CALLS, CacheBounds
from capture_proxy.proxy.recent import RecentCalls

MIB = 1 << 20
GIB = 1 << 30


@pytest.mark.parametrize(
    ("cpus", "memory", "exact", "workers"),
    [
        (64, None, False, 64),  # memory unknown: one per CPU
        (64, 2 * GIB, False, 8),  # a 2 GB sidecar on a 64-core node: 256 MB a worker
        (64, 2 * GIB, True, 2),  # with a tokenizer in each: 1 GB a worker
        (2, 24 * GIB, True, 2),  # this machine: the CPUs decide
        (8, 200 * MIB, False, 1),  # never fewer than one
        (8, 700 * MIB, True, 1),
    ],
)
def test_default_workers(cpus, memory, exact, workers):
    assert default_workers(cpus, memory, tokenizer=exact) == workers


@pytest.mark.parametrize(
    ("memory", "workers", "exact", "cache_mb"),
    [
        (None, 4, False, FULL_CACHE_MB),  # unknown: the full size
        (24 * GIB, 2, True, FULL_CACHE_MB),  # plenty: the full size, not more
        (2 * GIB, 2, False, 256),  # a quarter of 2 GB over 2 workers
        (2 * GIB, 8, False, 56),  # half of what 8 workers' 128 MB and the supervisor's leave
        (2 * GIB, 2, True, 224),  # (2,048 - 2 * 512 - 128) / 2 / 2
        (768 * MIB, 1, True, 128),  # half of what one worker's 512 MB leave, not a quarter
        (768 * MIB, 2, False, 96),
        (512 * MIB, 8, False, MIN_CACHE_MB),  # nothing left for 8: the floor
    ],
)
def test_default_cache_mb(memory, workers, exact, cache_mb):
    assert default_cache_mb(memory, workers, tokenizer=exact) == cache_mb


def test_the_full_bounds_are_the_caches_defaults_and_a_budget_scales_each():
    full = CacheBounds.of()
    assert full == CacheBounds(
        recent_bytes=512 * MIB,
        index_calls=FULL_INDEX_CALLS,
        message_facts_bytes=128 * MIB,
        request_bodies_bytes=128 * MIB,
        tools_bytes=16 * MIB,
    )
    # 512 + 128 + 128 + 16 MB and 131,072 calls at 3.5 KB: FULL_CACHE_MB in all
    assert (512 + 128 + 128 + 16) * MIB + FULL_INDEX_CALLS * 3584 == FULL_CACHE_MB * MIB
    assert RecentCalls().max_bytes == full.recent_bytes
    assert KnownMessages().max_bytes == full.message_facts_bytes
    assert KnownBodies().max_bytes == full.request_bodies_bytes
    assert KnownTools().max_bytes == full.tools_bytes
    quarter = CacheBounds.of(FULL_CACHE_MB // 4)  # 308 MB
    assert quarter == CacheBounds(
        recent_bytes=128 * MIB,
        index_calls=32_768,
        message_facts_bytes=32 * MIB,
        request_bodies_bytes=32 * MIB,
        tools_bytes=4 * MIB,
    )
    assert CacheBounds.of(64, index_calls=7).index_calls == 7  # link_index_max_calls wins


def test_settings_carry_the_budget_to_the_linkers_caches(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from capture_proxy.app import _linker
    from capture_proxy.proxy.keys import WorkerRole
    from capture_proxy.proxy.metrics import Metrics

    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 64)
    settings = Settings(backend="http://e:1", store=tmp_path / "s")
    assert settings.sizing()[:2] == (8, 56)
    base = {"backend": "http://e:1", "store": tmp_path / "s", "prompt_mode": "exact_tokens"}
    engine_renders = Settings(**base)  # the engine's /tokenize: no tokenizer in the workers
    assert engine_renders.sizing()[:2] == (8, 56)
    for local in ({"tokenizer": tmp_path}, {"model_families": {"m": "qwen3"}}):
        exact = Settings(**base, **local)  # a tokenizer in every worker
        assert (exact.loads_tokenizers, *exact.sizing()[:2]) == (
            True, 2, 224,
        )  # fmt: skip
    store = SimpleNamespace(shared=False)  # the linker only keeps it: no store is opened
    role = WorkerRole(0, 8, str(tmp_path))  # one of the 8 workers
    linker = _linker(settings, store, None, None, None, Metrics(), role)  # type: ignore[arg-type]
    expected = CacheBounds.of(56)
    assert linker.recent.max_bytes == expected.recent_bytes == 24_403_223  # 512 MiB * 56 / 1232
    assert linker.indexes.max_calls == expected.index_calls == 5957
    assert linker.known_messages.max_bytes == expected.message_facts_bytes
    assert linker.known_bodies.max_bytes == expected.request_bodies_bytes
    assert linker.known_tools.max_bytes == expected.tools_bytes
    chosen = Settings(
        backend="http://e:1", store=tmp_path / "s", cache_memory_mb=100, workers=3,
        link_index_max_calls=5,
    )  # fmt: skip
    assert chosen.sizing()[:2] == (3, 100)
    linker = _linker(chosen, store, None, None, None, Metrics())  # type: ignore[arg-type]
    assert linker.indexes.max_calls == 5
    assert linker.recent.max_bytes == CacheBounds.of(100).recent_bytes


def test_each_worker_is_told_the_count_and_budget_the_supervisor_decided(tmp_path, monkeypatch):
    """A worker pinned to one CPU would count one CPU and take all the memory's share: the
    supervisor's decision travels in the settings it is given."""
    import argparse
    import socket

    from capture_proxy.cli import serve, workers

    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 4)
    plans = []
    monkeypatch.setattr(workers, "run_workers", lambda plan, *a: plans.append(plan) or 0)
    settings = Settings(backend="http://e:1", store=tmp_path / "s")
    monkeypatch.setattr(serve, "settings_from_args", lambda args: settings)
    monkeypatch.setattr(serve, "_configure_logging", lambda settings: None)
    monkeypatch.setattr(serve, "_bind", lambda settings: socket.socket())
    args = argparse.Namespace(read_only=False, backend=None, port_file=None)
    assert serve.run(args) == 0
    (plan,) = plans
    assert plan.count == 4
    assert (plan.settings.workers, plan.settings.cache_memory_mb) == (4, 128)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 1)  # as a pinned worker sees
    assert plan.settings.sizing()[:2] == (4, 128)


def test_serve_says_what_the_memory_made_smaller(tmp_path, monkeypatch, caplog):
    from capture_proxy.cli import serve

    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 64)
    with caplog.at_level("INFO", logger="capture_proxy"):
        for settings in (
            Settings(backend="http://e:1", store=tmp_path / "s"),
            Settings(backend="http://e:1", store=tmp_path / "s", workers=1),
            Settings(backend="http://e:1", store=tmp_path, cache_memory_mb=64),
        ):
            serve._say_memory(settings, *settings.sizing())
    assert [r.getMessage() for r in caplog.records] == [
        "memory this process may use: 2,048 MB (the machine's, capped by its cgroup's limit): "
        "8 worker(s), caches at most 56 MB each (settings workers, cache_memory_mb)",
        # one worker gets a quarter of 2 GB: 512 MB, still below the full size
        "memory this process may use: 2,048 MB (the machine's, capped by its cgroup's limit): "
        "1 worker(s), caches at most 512 MB each (settings workers, cache_memory_mb)",
    ]  # chosen by the user: nothing to say


def test_a_process_serving_alone_takes_the_share_of_one(tmp_path, monkeypatch):
    """``demo``, ``replay`` and ``serve`` with one worker run one proxy process: its caches are
    not cut to a share of the workers its CPUs would have counted (64 here), which it does not
    run; a worker's are its share of the supervisor's count."""
    from types import SimpleNamespace

    from capture_proxy.app import _linker
    from capture_proxy.proxy.keys import WorkerRole
    from capture_proxy.proxy.metrics import Metrics

    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 64)
    settings = Settings(backend="http://e:1", store=tmp_path / "s")  # as demo builds them
    store = SimpleNamespace(shared=False)
    alone = _linker(settings, store, None, None, None, Metrics())  # type: ignore[arg-type]
    assert alone.recent.max_bytes == CacheBounds.of(512).recent_bytes  # a quarter of 2 GB
    role = WorkerRole(0, 8, str(tmp_path))
    one_of_8 = _linker(settings, store, None, None, None, Metrics(), worker=role)  # type: ignore[arg-type]
    assert one_of_8.recent.max_bytes == CacheBounds.of(56).recent_bytes


def test_only_a_tokenizer_loaded_in_each_worker_costs_a_gigabyte(tmp_path, monkeypatch):
    """``exact_tokens`` without ``tokenizer`` or ``model_families`` renders with the engine's
    ``/tokenize``: no tokenizer in the workers, the count of ``backend_template``."""
    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 64)
    base = {"backend": "http://e:1", "store": tmp_path / "s", "prompt_mode": "exact_tokens"}
    assert Settings(**base).sizing()[0] == 8  # the engine renders
    assert Settings(**base, tokenizer=tmp_path).sizing()[0] == 2
    assert Settings(**base, model_families={"m": "qwen3"}).sizing()[0] == 2
    template = {**base, "prompt_mode": "backend_template"}
    families = Settings(**template, model_families={"m": "qwen3"})
    assert families.sizing()[0] == 8  # families set but no model in exact_tokens: not loaded
    by_model = {
        **base,
        "prompt_mode": "backend_template",
        "prompt_mode_by_model": {"m": "exact_tokens"},
    }
    assert Settings(**by_model, tokenizer=tmp_path).sizing()[0] == 2


def test_serve_counts_its_workers_once(tmp_path, monkeypatch, caplog):
    """The count ``serve`` says, the one it chooses workers by and the one it runs are one
    reading of the CPUs and memory (a container resized while it starts reads differently)."""
    import argparse
    import socket

    from capture_proxy.cli import serve, workers

    cpus = iter([4, 3, 2, 1, 1, 1, 1, 1])
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: next(cpus))
    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    settings = Settings(backend="http://e:1", store=tmp_path / "s")
    monkeypatch.setattr(serve, "settings_from_args", lambda args: settings)
    monkeypatch.setattr(serve, "_configure_logging", lambda settings: None)
    monkeypatch.setattr(serve, "_bind", lambda settings: socket.socket())
    plans: list = []
    monkeypatch.setattr(workers, "run_workers", lambda plan, *a: plans.append(plan) or 0)
    monkeypatch.setattr(serve, "_run_app", lambda *a: plans.append("one process"))
    args = argparse.Namespace(read_only=False, backend=None, port_file=None)
    with caplog.at_level("INFO", logger="capture_proxy"):
        assert serve.run(args) == 0
    (plan,) = plans
    assert (plan.count, plan.settings.workers, plan.settings.cache_memory_mb) == (4, 4, 128)
    assert "4 worker(s), caches at most 128 MB each" in caplog.text


@pytest.mark.parametrize(("cpus", "count", "cache_mb"), [(4, 4, 128), (1, 1, 512)])
def test_serve_reads_the_cache_budget_once(tmp_path, monkeypatch, caplog, cpus, count, cache_mb):
    """The caches ``serve`` says each process holds are the ones its workers (or its one
    process) hold, sized with the count by one reading of the memory, as of the CPUs (a
    container resized while it starts reads differently each time)."""
    import argparse
    import socket

    from capture_proxy.cli import serve, workers

    memory = iter([2 * GIB] + [GIB // 2] * 8)  # the first reading, then a smaller limit
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: next(memory))
    settings = Settings(backend="http://e:1", store=tmp_path / "s")
    monkeypatch.setattr(serve, "settings_from_args", lambda args: settings)
    monkeypatch.setattr(serve, "_configure_logging", lambda settings: None)
    monkeypatch.setattr(serve, "_bind", lambda settings: socket.socket())
    held: list = []
    monkeypatch.setattr(workers, "run_workers", lambda plan, *a: held.append(plan.settings) or 0)
    monkeypatch.setattr(serve, "_run_app", lambda args, settings, sock: held.append(settings))
    args = argparse.Namespace(read_only=False, backend=None, port_file=None)
    with caplog.at_level("INFO", logger="capture_proxy"):
        assert serve.run(args) == 0
    (chosen,) = held
    assert caplog.messages == [
        "memory this process may use: 2,048 MB (the machine's, capped by its cgroup's limit): "
        f"{count} worker(s), caches at most {cache_mb} MB each (settings workers, "
        "cache_memory_mb)"
    ]
    assert chosen.cache_mb_for(count) == cache_mb  # what its linkers take (app._linker)


def test_a_tokenizer_the_viewer_loads_counts_in_every_prompt_mode(tmp_path, monkeypatch):
    """The viewer loads ``tokenizer`` in each process on its first page showing token text
    (``viewer/detokenize.py`` ``LocalDetokenizer``), in ``backend_template`` and in ``serve
    --read-only`` (where the viewer is the point) as in ``exact_tokens``: 92 MB resident to
    336 MB measured (``transformers``' ``AutoTokenizer``, the built-in Qwen tokenizer, no
    ``torch``). 8 workers in 2 GB each loading it would pass the limit."""
    monkeypatch.setattr(settings_module, "usable_memory_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(settings_module, "usable_cpus", lambda: 64)
    viewer = Settings(backend="http://e:1", store=tmp_path / "s", tokenizer=tmp_path)
    assert viewer.prompt_mode == "backend_template"
    assert (viewer.loads_tokenizers, *viewer.sizing()[:2]) == (
        True, 2, 224,
    )  # fmt: skip
