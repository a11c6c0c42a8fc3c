"""Worker processes of the training-loop tests that need a process group (the PROCESS executor).

``python _loop_workers.py process-bn RANK WORLD PORT DIR``: one rank trains a BatchNorm model with
an EMA hook and saves through DCP's PROCESS executor, with ``dcp.async_save`` and with ours,
running the next forward while staging is held (every staging copy waits for a gate the worker
opens after forward and backward). It writes the state at each call as
``DIR/{mode}.expected.pt``; the test loads each checkpoint and compares.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import FUTURE_TIMEOUT_S, _init, run_worker  # noqa: E402


def _process_bn(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from test_training_loops import forward_backward, frozen_copy, state_of, train_step, training
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import DataStatesWriter, async_save
    from dcp_datastates.providers.tensor import TensorProvider

    gate = threading.Event()
    copy_into = TensorProvider.copy_into

    def gated(self: Any, dst: Any, start: int, stop: int) -> None:
        gate.wait(FUTURE_TIMEOUT_S)
        copy_into(self, dst, start, stop)

    TensorProvider.copy_into = gated  # this process only: DCP's daemon is spawned fresh
    _init(rank, world_size, port)
    report: dict[str, Any] = {"modes": []}
    try:
        model, optimizer = training(width=256)
        train_step(model, optimizer)
        kind = AsyncCheckpointerType.PROCESS
        for mode in ("dcp_async", "ours"):
            state = state_of(model, optimizer)
            torch.save(frozen_copy(state), workdir / f"{mode}.expected.pt")
            path = workdir / mode
            if mode == "dcp_async":
                response = dcp.async_save(
                    state, storage_writer=DataStatesWriter(path), async_checkpointer_type=kind
                )
            else:
                response = async_save(state, path, async_checkpointer_type=kind)
            optimizer.zero_grad()
            forward_backward(model)  # right away: BatchNorm, EMA and counter change in place
            if response.staging_completion.done():
                raise AssertionError("staging completed before forward: nothing was tested")
            gate.set()
            optimizer.step()  # the guard holds it until staging completes
            response.upload_completion.result(timeout=FUTURE_TIMEOUT_S)
            report["modes"].append(mode)
            gate.clear()
    finally:
        dist.destroy_process_group()
    return report


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if scenario != "process-bn":
        raise ValueError(f"unknown scenario {scenario!r}")
    return _process_bn(rank, world_size, port, workdir)


if __name__ == "__main__":  # the guard also keeps DCP's spawned daemon from re-running a scenario
    sys.exit(run_worker(sys.argv[1:], _scenario))  # normal teardown: DCP's daemon must end
