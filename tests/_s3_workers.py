"""Rank processes that save to S3 (moto on loopback): ``python _s3_workers.py SCENARIO RANK WORLD
PORT DIR``, run by ``_dist_workers.launch(..., script=__file__)``. The bucket URL and endpoint come
from ``DCP_TEST_S3_URL`` and ``DCP_TEST_S3_ENDPOINT``; credentials from the environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import (  # noqa: E402
    FUTURE_TIMEOUT_S,
    _init,
    _mutate,
    _rank_state,
    exit_without_teardown,
    run_worker,
)


def _scenario_save(rank: int, world_size: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    try:
        options = {"endpoint_url": os.environ["DCP_TEST_S3_ENDPOINT"], "part_bytes": 5 << 20}
        writer = DataStatesWriter(os.environ["DCP_TEST_S3_URL"], storage_options=options)
        state = _rank_state(world_size)
        response = async_save(state, writer)
        response.staging_completion.result(timeout=FUTURE_TIMEOUT_S)
        _mutate(state)  # the snapshot is complete: training may go on
        response.upload_completion.result(timeout=FUTURE_TIMEOUT_S)
        writer.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {}


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if scenario != "save":
        raise ValueError(f"unknown scenario {scenario!r}")
    return _scenario_save(rank, world_size, port)


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
