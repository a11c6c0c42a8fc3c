"""Worker processes for the peer replication tests (``tests/test_peers.py``).

``python _peer_workers.py SCENARIO RANK WORLD PORT DIR`` (run through
``_dist_workers.launch(script=__file__)``). Ranks ``2k`` and ``2k+1`` form simulated node ``k``,
whose memory root is ``DIR/mem/node<k>``; step ``STEP``'s checkpoint there holds each local
rank's data file and the node's copy of ``.metadata`` and the manifest.

    replicate  each rank writes its files into its node's step directory, then replicates them
               while running all-reduces on the default group (what training does meanwhile);
               reports the future's result and how many all-reduces ran before it was done.
               That is step STEP-2; then STEP-1, which names a file missing on rank 0, and
               STEP; each rank prunes its replicas to the newest one.
    restore    for each tree in RESTORE_TREES (``DIR/<tree>/node<k>``): a rank whose data file
               is gone from its node's root says it lost its memory; every rank calls restore()
               with one replicator; reports, per tree, what it got back, or how it failed.
    die        rank 3 exits right after the replicator is built; the others replicate; reports
               how each rank's future ended (rank 1 sends to and receives from rank 3).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import (  # noqa: E402
    FUTURE_TIMEOUT_S,
    _init,
    exit_without_teardown,
    run_worker,
)

STEP = 5
RANKS_PER_NODE = 2
CHUNK = 64 << 10
#: The memory trees the restore scenario restores from, in order (the test prepares them).
RESTORE_TREES = ("mem_corrupt", "mem_lost")


def node_root(workdir: Path, rank: int, mem: str = "mem") -> Path:
    return Path(workdir) / mem / f"node{rank // RANKS_PER_NODE}"


def data_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def file_bytes(name: str, rank: int) -> bytes:
    """The bytes of ``name`` as rank ``rank`` writes them: a data file a few chunks long and not
    a whole number of them; small global files the same on every rank."""
    import torch

    if name == ".metadata":
        return b"metadata of step %d" % STEP
    if name == ".datastates.json":
        return b""  # an empty file travels too
    g = torch.Generator().manual_seed(1000 + rank)
    n = 40 * CHUNK + 12345 * (rank + 1)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def rank_files(rank: int) -> list[str]:
    return [data_name(rank), ".metadata", ".datastates.json"]


def _replicator(rank: int) -> Any:
    from dcp_datastates.checkpointers.peers import PeerReplicator

    return PeerReplicator(
        ranks_per_node=RANKS_PER_NODE, chunk_bytes=CHUNK, timeout=timedelta(seconds=20)
    )


def _write_files(rank: int, workdir: Path) -> Path:
    step_dir = node_root(workdir, rank) / f"step_{STEP}"
    step_dir.mkdir(parents=True, exist_ok=True)
    for name in rank_files(rank):
        if name == data_name(rank) or rank % RANKS_PER_NODE == 0:
            (step_dir / name).write_bytes(file_bytes(name, rank))
    return step_dir


def _scenario_replicate(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dcp_datastates.checkpointers.peers import PeerReplicationError

    _init(rank, world_size, port)
    step_dir = _write_files(rank, workdir)
    dist.barrier()  # each node's .metadata is written before anyone sends it
    replicator = _replicator(rank)
    root = node_root(workdir, rank)
    future = replicator.replicate(STEP - 2, step_dir, rank_files(rank), root)
    want, sums_ok, before_done = sum(range(1, world_size + 1)), True, 0
    for _ in range(200):  # the same number on every rank: a training loop's collectives
        grad = torch.full((1 << 16,), float(rank + 1))
        dist.all_reduce(grad)
        sums_ok &= bool((grad == want).all())
        before_done += not future.done()
    future.result(timeout=FUTURE_TIMEOUT_S)
    # A file rank 0 cannot read fails its step on rank 0 and on rank 2 (which receives it) only,
    # and leaves the group in step: the next one replicates everywhere.
    files = [*rank_files(rank), "missing.distcp"] if rank == 0 else rank_files(rank)
    failed = replicator.replicate(STEP - 1, step_dir, files, root)
    try:
        failed.result(timeout=FUTURE_TIMEOUT_S)
        failure = None
    except PeerReplicationError as e:
        failure = str(e)
    report = replicator.replicate(STEP, step_dir, rank_files(rank), root).result(
        timeout=FUTURE_TIMEOUT_S
    )
    pruned = replicator.prune(root, keep=1)  # this rank's replicas of steps STEP - 2 and STEP
    kept = sorted(p.name for p in report.replica.parent.iterdir())
    replicator.close()
    dist.destroy_process_group()
    return {
        "failure": failure,
        "pruned": sorted(p.name for p in pruned),
        "kept_after_prune": kept,
        "peer": report.peer,
        "source": report.source,
        "replica": str(report.replica),
        "bytes_sent": report.bytes_sent,
        "bytes_received": report.bytes_received,
        "all_reduces_while_replicating": before_done,
        "all_reduce_ok": sums_ok,
    }


def _scenario_restore(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from dcp_datastates.checkpointers.peers import PeerRestoreError

    _init(rank, world_size, port)
    replicator = _replicator(rank)
    report: dict[str, Any] = {}
    for mem in RESTORE_TREES:  # one replicator: a failed restore leaves the group in step
        root = node_root(workdir, rank, mem)
        step_dir = root / f"step_{STEP}"
        lost = not (step_dir / data_name(rank)).exists()
        seen: dict[str, Any] = {"lost": lost}
        try:
            seen["restored"] = replicator.restore(STEP, lost, step_dir, root)
        except PeerRestoreError as e:
            seen["error"] = str(e)
            seen["failures"] = {str(k): v for k, v in e.failures.items()}
        report[mem] = seen
    replicator.close()
    dist.destroy_process_group()
    return report


def _scenario_die(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    from dcp_datastates.checkpointers.peers import PeerReplicationError

    _init(rank, world_size, port)
    step_dir = _write_files(rank, workdir)
    replicator = _replicator(rank)
    if rank == 3:
        exit_without_teardown(0)  # the node's second process dies before any replication
    future = replicator.replicate(STEP, step_dir, rank_files(rank), node_root(workdir, rank))
    report: dict[str, Any] = {}
    try:
        report["result"] = str(future.result(timeout=FUTURE_TIMEOUT_S * 2))
    except PeerReplicationError as e:
        report["error"] = str(e)
        report["error_fields"] = [e.rank, e.peer, e.source, e.step]
    again = replicator.replicate(STEP + 1, step_dir, rank_files(rank), node_root(workdir, rank))
    try:
        again.result(timeout=FUTURE_TIMEOUT_S * 2)
        report["again"] = "ok"
    except PeerReplicationError as e:
        report["again"] = str(e)
    report["trained_on"] = True  # this rank's own thread was never interrupted
    return report


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    run = {
        "replicate": _scenario_replicate,
        "restore": _scenario_restore,
        "die": _scenario_die,
    }[scenario]
    return run(rank, world_size, port, workdir)


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
