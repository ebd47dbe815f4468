# SPDX-License-Identifier: Apache-2.0
"""``vllm_gpu.py``'s engines, their order over rounds, the pooled figures and the table.

:data:`ENGINES` names the engines one run compares; :func:`round_order` gives the order of a
round (forward, then backward: the machine's drift over a run weighs on every engine alike);
:func:`pooled` takes the medians of one engine over its rounds; :func:`print_rounds` and
:func:`print_table` print them against vLLM alone and the physical bound.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

ENGINES = {
    "base": "vLLM alone",
    "on": "lmc sums on",
    "off": "lmc sums off",
    "offload": "vLLM offload",
}
"""Engine name: column header. ``on``/``off``: lmcache with its checksums on/off; ``offload``:
vLLM's own ``OffloadingConnector`` over as many host bytes as lmcache's pool."""

_W = 13  # column width
_OK = {True: "met", False: "MISSED"}


def round_order(engines: Sequence[str], rnd: int) -> list[str]:
    """Round ``rnd``'s order: ``engines`` forward in even rounds, backward in odd ones (base, on,
    off, offload, offload, off, on, base, ...)."""
    return list(engines) if rnd % 2 == 0 else list(reversed(engines))


def pooled(rounds: Sequence[dict[str, list[float]]]) -> dict[str, float]:
    """Medians over every round's samples of one engine; ``warm1`` is the first warm request
    of each engine (its first load), ``warm_later`` the others."""

    def med(name: str, pick: slice = slice(None)) -> float:
        xs = [x for r in rounds for x in r[name][pick]]
        return statistics.median(xs) if xs else float("nan")

    out = {
        name: med(name)
        for name in ("cold", "floor", "warm", "cold_wall", "warm_wall", "tput", "warm_hit")
    }
    out["warm1"] = med("warm", slice(0, 1))
    out["warm_later"] = med("warm", slice(1, None))
    return out


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f} %"


def print_rounds(samples: dict[str, list[dict[str, list[float]]]]) -> None:
    """One line per round: every engine's cold TTFT, later warm TTFT and throughput against
    vLLM alone's of the same round (absolute figures without a ``base`` engine)."""
    rounds = len(next(iter(samples.values())))
    for rnd in range(rounds):
        one = {e: pooled(s[rnd : rnd + 1]) for e, s in samples.items()}
        base = one.get("base")
        cells = []
        for engine, p in one.items():
            if base is None:
                cells.append(
                    f"{engine} cold {1e3 * p['cold']:.1f} ms, warm {1e3 * p['warm_later']:.1f} "
                    f"ms, {p['tput']:.0f} tok/s"
                )
            elif engine != "base":
                cells.append(
                    f"{engine} cold {_pct(p['cold'], base['cold'])}, warm "
                    f"{1e3 * p['warm_later']:.1f} ms, tput {100 * p['tput'] / base['tput']:.1f} %"
                )
        ref = "" if base is None else f" (vLLM alone: cold {1e3 * base['cold']:.1f} ms)"
        print(f"round {rnd + 1}{ref}: " + "; ".join(cells), flush=True)


def _row(label: str, cells: Sequence[str], target: str = "") -> None:
    print(f"{label:<34}" + "".join(f"{c:>{_W}}" for c in cells) + (f"  {target}" if target else ""))


def _verdict(target: str, results: dict[str, bool], none: str = "no engine to judge") -> str:
    if not results:
        return f"{target}: - ({none})"
    missed = [e for e, ok in results.items() if not ok]
    return f"{target}: " + (f"MISSED ({', '.join(missed)})" if missed else "met")


def print_table(
    p: dict[str, dict[str, float]],
    title: str,
    h2d_ms: float,
    kv_bytes: int,
) -> None:
    """The comparison: a column per engine of ``p`` (its :func:`pooled` figures), each figure
    beside its target. The physical bound is ``kv_bytes`` over the pinned host-to-device copy
    (``h2d_ms``) plus vLLM alone's floor (another engine's without a ``base`` engine)."""
    engines = list(p)
    base = p.get("base")
    loaders = [e for e in engines if e != "base"]  # engines whose warm request is a load
    floor_of = "base" if base is not None else engines[0]
    bound = h2d_ms / 1e3 + p[floor_of]["floor"]
    print(f"\n=== {title}")
    _row("", [ENGINES[e] for e in engines], "target")

    def values(key: str, scale: float = 1e3, fmt: str = ".1f") -> list[str]:
        return [format(scale * p[e][key], fmt) for e in engines]

    def against_base(key: str) -> dict[str, float]:
        """Each loading engine's ``key`` over vLLM alone's (none without a ``base`` engine)."""
        return {} if base is None else {e: p[e][key] / base[key] for e in loaders}

    _row("cold TTFT (ms)", values("cold"))
    ratio = against_base("cold")
    cells = ["" if e not in ratio else f"{100 * (ratio[e] - 1):+.1f} %" for e in engines]
    _row(
        "  against vLLM alone",
        cells,
        _verdict("<= +2 %", {e: r <= 1.02 for e, r in ratio.items()}, "needs engine base"),
    )
    _row("1st warm TTFT after reset (ms)", values("warm1"))
    _row("later warm TTFT after reset (ms)", values("warm_later"))
    _row("warm prefix hit (tokens)", values("warm_hit", 1, ".0f"))
    over = {e: p[e]["warm_later"] / bound for e in engines}
    _row(
        "  later warm / physical bound",
        [f"{over[e]:.2f}x" + ("*" if e == "base" else "") for e in engines],
        _verdict("<= 1.1x", {e: over[e] <= 1.1 for e in loaders}),
    )
    first = {e: p[e]["warm1"] / p[e]["warm_later"] for e in engines}
    _row(
        "  1st / later warm",
        [f"{first[e]:.2f}x" for e in engines],
        _verdict("<= 1.1x", {e: first[e] <= 1.1 for e in loaders}),
    )
    if "on" in p and "off" in p:
        on, off = p["on"], p["off"]
        sums = on["warm_later"] / off["warm_later"]
        _row(
            "  checksum on against off, warm",
            [f"{100 * (sums - 1):+.1f} %" if e == "on" else "" for e in engines],
            _verdict("<= +3 %", {"on": sums <= 1.03})
            + f" (1st warm {_pct(on['warm1'], off['warm1'])}, cold "
            f"{_pct(on['cold'], off['cold'])}, tput {_pct(on['tput'], off['tput'])})",
        )
    else:
        _row("  checksum on against off, warm", ["-"] * len(engines), "needs engines on and off")
    _row("throughput, 0 % reuse (tok/s)", values("tput", 1, ".0f"))
    ratio = against_base("tput")
    cells = ["" if e not in ratio else f"{100 * ratio[e]:.1f} %" for e in engines]
    _row(
        "  against vLLM alone",
        cells,
        _verdict(">= 99 %", {e: r >= 0.99 for e, r in ratio.items()}, "needs engine base"),
    )
    _row(
        "generate() wall, cold/warm (ms)",
        [f"{1e3 * p[e]['cold_wall']:.1f}/{1e3 * p[e]['warm_wall']:.1f}" for e in engines],
        "(TTFT + this process's detokenization)",
    )
    print(
        f"physical bound {1e3 * bound:.1f} ms = KV {kv_bytes / 2**20:.0f} MiB / pinned h2d "
        f"{kv_bytes / h2d_ms / 1e6:.1f} GB/s ({h2d_ms:.1f} ms) + one decode step, the {floor_of} "
        f"engine's TTFT of a full prefix-cache hit ({1e3 * p[floor_of]['floor']:.1f} ms),\n"
        "  both measured in this run; floors: "
        + ", ".join(f"{e} {1e3 * p[e]['floor']:.1f}" for e in engines)
        + " ms"
        + ("; *vLLM alone's warm request is a recompute" if base is not None else "")
    )
