"""The disk's write limit as the best writer would reach it, and the durable targets against it.

A limit taken one way (four files of 8 MiB ``O_DIRECT`` writes) understated this disk: ours,
which writes 32 MiB at a time, was durable at 1.8x that "limit" (issue 41), so "durable >= 0.9x
the limit" said nothing. Each time the limit is due, the same bytes are written and fsynced in
a small sweep of ways, in alternating order: exactly ours (``flush_workers`` files in parallel,
one thread each, ``localfile.DIRECT_BUFFER`` writes, ``O_DIRECT``, one fsync per file at the
end), twice and half as many files (the queue depth), a quarter and twice the write size, and
through the page cache. The limit of the round is the best of them: never below what our own
pattern reaches raw, and above it wherever another pattern does better on this disk at that
moment. Where the file system refuses ``O_DIRECT``, the sweep is the page-cache patterns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dcp_datastates.options import WriterOptions
from dcp_datastates.storage import localfile

from .common import GB, Recorder, Spread, alternate
from .limits import direct_supported, file_share, write_fsync
from .systems import SAVE_SYSTEMS

MiB = 1 << 20
#: The save rotation's limit: per round, the best configuration of the sweep.
BEST = "raw best writer (max of the sweep)"
#: The same in the limits scenario.
LIMITS_BEST = "best writer (max of the sweep)"
SWEEP = "disk_sweep"
OURS = SAVE_SYSTEMS["ours-async-1"]


@dataclass(frozen=True)
class WriteConfig:
    """One way to write and fsync the bytes: ``files`` in parallel (a thread each), each in
    ``write_bytes`` writes, with ``O_DIRECT`` or through the page cache."""

    files: int
    write_bytes: int
    direct: bool

    @property
    def label(self) -> str:
        mode = "direct" if self.direct else "buffered"
        tag = " (ours)" if self == ours() else ""
        return f"{mode} {self.files} files x {self.write_bytes // MiB} MiB writes{tag}"


def ours() -> WriteConfig:
    """How a writer with default options writes a rank's data files on a local disk."""
    return WriteConfig(
        files=WriterOptions().flush_workers, write_bytes=localfile.DIRECT_BUFFER, direct=True
    )


def configs(direct: bool) -> list[WriteConfig]:
    """The sweep, ours first; without ``direct`` (refused by the file system) buffered only."""
    o = ours()
    every = [
        o,
        replace(o, files=2 * o.files),
        replace(o, files=max(1, o.files // 2)),
        replace(o, write_bytes=max(MiB, o.write_bytes // 4)),
        replace(o, write_bytes=2 * o.write_bytes),
        replace(o, direct=False),
    ]
    if not direct:
        every = [replace(c, direct=False) for c in every]
    return list(dict.fromkeys(every))


def sweep(
    rec: Recorder, workdir: Path, nbytes: int, r: int, context: str
) -> tuple[str, float, float]:
    """Write ``nbytes`` in each configuration (order alternating by round), one record each
    (scenario ``disk_sweep``); the best configuration's label, seconds and GB/s."""
    results: dict[str, tuple[float, float]] = {}
    for c in alternate(configs(direct_supported(workdir)), r):
        seconds = write_fsync(workdir, nbytes, c.files, direct=c.direct, block=c.write_bytes)
        written = file_share(nbytes, c.files) * c.files
        results[c.label] = (seconds, written / GB / seconds)
        rec.emit(
            SWEEP,
            c.label,
            {"seconds": seconds, "gb_per_s": written / GB / seconds},
            bytes=written,
            files=c.files,
            write_bytes=c.write_bytes,
            direct=c.direct,
            context=context,
            round=r,
        )
    best = max(results, key=lambda k: results[k][1])
    return best, *results[best]


def emit_best(rec: Recorder, workdir: Path, nbytes: int, r: int, **fields: Any) -> None:
    """The save rotation's limit of round ``r``: the sweep, then its best as ``BEST``."""
    best, seconds, gbps = sweep(rec, workdir, nbytes, r, "save")
    figures = {"durable_s": seconds, "durable_gb_per_s": gbps}
    rec.emit("save", BEST, figures, config=best, bytes=nbytes, round=r, **fields)


def sweep_table(rec: Recorder) -> str | None:
    """GB/s of each configuration (median [min-max] over rounds) and how often it was best: the
    save rotation's sweeps, or where the save scenario did not run, the limits scenario's."""
    recs = rec.select(SWEEP, context="save") or rec.select(SWEEP, context="limits")
    if not recs:
        return None
    by_round: dict[tuple[str, int], dict[str, float]] = {}
    for x in recs:
        by_round.setdefault((x["context"], x["round"]), {})[x["system"]] = x["figures"]["gb_per_s"]
    wins = [max(v, key=lambda k: v[k]) for v in by_round.values()]
    rows = []
    for name in dict.fromkeys(x["system"] for x in recs):
        s = Spread.of(x["figures"]["gb_per_s"] for x in recs if x["system"] == name)
        rows.append(f"| {name} | {'-' if s is None else s.fmt(2)} | {wins.count(name)} |")
    return (
        f"### Disk write limit: the sweep ({recs[0]['context']} scenario, "
        f"{recs[0]['bytes'] / GB:.2f} GB, write+fsync)\n\n"
        "| configuration | GB/s | best in rounds |\n|---|---|---|\n" + "\n".join(rows)
    )


# -- the durable targets ------------------------------------------------------------------------
def _limits_by_round(f: Any) -> dict[int, float]:
    """The save rotation's limit of each round: ``BEST``, or in runs recorded before the sweep,
    the best of their raw write+fsync systems."""
    names = (
        [BEST]
        if f.rec.select("save", system=BEST)
        else [n for n in f.systems("save") if n.startswith("raw")]
    )
    out: dict[int, float] = {}
    for n in names:
        for r in f.rec.select("save", system=n):
            out[r["round"]] = max(out.get(r["round"], 0.0), r["figures"]["durable_gb_per_s"])
    return out


def _per_round(f: Any) -> list[float]:
    limit = _limits_by_round(f)
    return [
        r["figures"]["durable_gb_per_s"] / limit[r["round"]]
        for r in f.rec.select("save", system=OURS)
        if limit.get(r["round"])
    ]


def durable_vs_limit(f: Any) -> tuple[float | None, str]:
    """Ours' median durable GB/s over the median of the rounds' best-writer limits (the limits
    scenario's best writer where the save rotation has none)."""
    ours_gbps = f.spread("save", OURS, "durable_gb_per_s")
    limit = Spread.of(_limits_by_round(f).values()) or f.spread("limits", LIMITS_BEST, "gb_per_s")
    if ours_gbps is None or limit is None or limit.median <= 0:
        return None, "needs save (and its write limit)"
    detail = f"{ours_gbps.fmt(3)} / {limit.fmt(3)} GB/s"
    configs_won = [r.get("config") for r in f.rec.select("save", system=BEST)]
    if configs_won:
        detail += "; best: " + ", ".join(dict.fromkeys(c for c in configs_won if c))
    if rounds := _per_round(f):
        detail += "; per round " + ", ".join(f"{x:.2f}" for x in rounds)
    return ours_gbps.median / limit.median, detail


def durable_every_round(f: Any) -> tuple[float | None, str]:
    """The worst round's ratio: ours against the limit of the same round of the rotation."""
    rounds = _per_round(f)
    if not rounds:
        return None, "needs save with its write limit"
    return min(rounds), "per round: " + ", ".join(f"{x:.2f}" for x in rounds)
