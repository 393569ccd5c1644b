"""The concurrency sweep's figures (``cpu_sweep.py``): one cell's measurements and the tables.

A cell is one phase: a target (a proxy by prompt mode, or ``direct``: the engine without a
proxy), streaming or not, C clients. Its CPU figures are per completed call: the measured
process (the proxy; the engine for ``direct``), the engine, and the proxy's threads by role
(user and system apart). Must not: start processes or send calls.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.sessions import CallResult, pct

DIRECT = "direct"
#: the proxy's threads by role, in the order printed (``services.thread_cpu_s``)
ROLES = ("main", "capture-store-w", "capture-store-r", "other")
ROLE_LABELS = {"main": "main", "capture-store-w": "writer", "capture-store-r": "reader"}
#: issue 22's targets: proxy CPU ms per call at one client (non-stream, 32-token stream) and
#: the most CPU per call at 16 clients may cost against one client
ONE_CLIENT_MS = {False: 1.0, True: 1.5}
STREAM_TOKENS = 32
C16_RATIO = 1.3


@dataclass
class Cell:
    """One phase's figures (CPU in ms per completed call)."""

    mode: str
    stream: bool
    clients: int
    cpu_ms_per_call: float  # the proxy (the engine for ``direct``), all threads
    engine_ms_per_call: float
    calls: int
    calls_per_s: float
    results: list[CallResult]
    #: role -> (user, system) ms per call, the proxy's live threads (empty for ``direct``)
    threads_ms: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def latency_p50_ms(self) -> float:
        return pct([r.latency_s for r in self.results if r.ok], 50) * 1000

    def generation_tokens(self) -> Counter[int]:
        """How many calls had each generation token count (``usage.completion_tokens``)."""
        return Counter(int(r.usage["completion_tokens"]) for r in self.results if r.ok and r.usage)


Cells = dict[tuple[str, bool, int], list[Cell]]


def _median(runs: list[Cell], get: Callable[[Cell], float]) -> float:
    return statistics.median(get(r) for r in runs)


def report(cells: Cells, clients: list[int], modes: list[str]) -> None:
    """Every table: CPU per call by C, the per-call breakdown, the targets, the raw JSON."""
    _by_clients(cells, clients, [DIRECT, *modes])
    for c in clients:
        _breakdown(cells, c, modes)
    _targets(cells, clients, modes)
    print(
        json.dumps(
            {
                f"{m}|{'stream' if s else 'whole'}|{c}": [r.cpu_ms_per_call for r in v]
                for (m, s, c), v in cells.items()
            }
        )
    )


def _by_clients(cells: Cells, clients: list[int], names: list[str]) -> None:
    print(
        "\nCPU ms per call (the proxy; for direct the engine): median (min-max over repeats); "
        "calls/s median"
    )
    head = f"  {'mode':<22}{'stream':<8}" + "".join(f"{'C=' + str(c):>26}" for c in clients)
    print(head + "".join(f"{f'C={c}/C={clients[0]}':>12}" for c in clients[1:]))
    for name in names:
        for stream in (True, False):
            row = f"  {name:<22}{'yes' if stream else 'no':<8}"
            med = {}
            for c in clients:
                runs = cells[(name, stream, c)]
                cpu = [r.cpu_ms_per_call for r in runs]
                med[c] = statistics.median(cpu)
                rate = _median(runs, lambda r: r.calls_per_s)
                row += f"{med[c]:>7.2f} ({min(cpu):.2f}-{max(cpu):.2f}) {rate:>6.0f}/s"
            row += "".join(f"{med[c] / med[clients[0]]:>11.2f}x" for c in clients[1:])
            print(row)


def _breakdown(cells: Cells, c: int, modes: list[str]) -> None:
    """At C clients: generation tokens, the proxy's CPU by thread, the engine's, latency, and
    the direct call's figures beside (medians over repeats)."""
    print(
        f"\nC={c}, per call, medians over repeats: generation tokens (calls); proxy CPU ms "
        "by thread, user+system; engine CPU ms; latency p50 ms; the direct call's beside"
    )
    print(
        f"  {'mode':<22}{'stream':<7}{'gen tokens':<16}{'proxy':>7}"
        + "".join(f"{ROLE_LABELS.get(r, r):>13}" for r in ROLES)
        + f"{'engine':>8}{'p50':>8}{'direct engine':>15}{'direct p50':>12}"
        + f"{'proxy/direct engine':>21}{'added p50':>11}"
    )
    for mode in modes:
        for stream in (True, False):
            runs, direct = cells[(mode, stream, c)], cells[(DIRECT, stream, c)]
            tokens = sum((r.generation_tokens() for r in runs), Counter())
            shown = ",".join(f"{n}({k})" for n, k in sorted(tokens.items()))
            cpu = _median(runs, lambda r: r.cpu_ms_per_call)
            row = f"  {mode:<22}{'yes' if stream else 'no':<7}{shown:<16}{cpu:>7.2f}"
            for role in ROLES:
                u = statistics.median(r.threads_ms.get(role, (0.0, 0.0))[0] for r in runs)
                s = statistics.median(r.threads_ms.get(role, (0.0, 0.0))[1] for r in runs)
                row += f"{f'{u:.2f}+{s:.2f}':>13}"
            d_cpu = _median(direct, lambda r: r.cpu_ms_per_call)
            p50, d_p50 = _median(runs, _p50), _median(direct, _p50)
            row += f"{_median(runs, lambda r: r.engine_ms_per_call):>8.2f}{p50:>8.2f}"
            row += f"{d_cpu:>15.2f}{d_p50:>12.2f}{cpu / d_cpu:>20.2f}x{p50 - d_p50:>+11.2f}"
            print(row)


def _p50(cell: Cell) -> float:
    return cell.latency_p50_ms


def _targets(cells: Cells, clients: list[int], modes: list[str]) -> None:
    """Issue 22's targets, each with PASS or FAIL."""
    print()
    for mode in modes:
        for stream in (True, False):
            kind = "stream" if stream else "non-stream"
            if 1 in clients:
                runs = cells[(mode, stream, 1)]
                cpu = _median(runs, lambda r: r.cpu_ms_per_call)
                limit = ONE_CLIENT_MS[stream]
                tokens = sum((r.generation_tokens() for r in runs), Counter())
                ok = cpu <= limit and (not stream or set(tokens) == {STREAM_TOKENS})
                need = f", {STREAM_TOKENS} tokens per call" if stream else ""
                print(
                    f"target: {mode} {kind}: one client's proxy CPU per call {cpu:.2f} ms "
                    f"<= {limit} ms{need}: {'PASS' if ok else 'FAIL'}"
                )
            if 1 in clients and 16 in clients:
                one = _median(cells[(mode, stream, 1)], lambda r: r.cpu_ms_per_call)
                sixteen = _median(cells[(mode, stream, 16)], lambda r: r.cpu_ms_per_call)
                ratio = sixteen / one
                print(
                    f"target: {mode} {kind}: C=16/C=1 {ratio:.2f}x <= {C16_RATIO}x: "
                    f"{'PASS' if ratio <= C16_RATIO else 'FAIL'}"
                )
