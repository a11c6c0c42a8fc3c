"""Run by test_writer_lifecycle: a child made by os.fork() while the parent's save is in flight
(``python _fork_worker.py DIR``; prints OK and the child's exit status, or why not)."""

import gc
import os
import sys
import threading

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter, WriterClosedError, register_provider
from dcp_datastates.providers.tensor import TensorProvider

root = sys.argv[1]
torch.set_num_threads(1)  # a forked child cannot use an OpenMP pool its parent started (libgomp)
gate = threading.Event()  # the parent's snapshot copies wait for it: in flight at the fork


class Gated(TensorProvider):
    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        assert gate.wait(60), "the gate was never opened"
        super().copy_into(dst, start, stop)


register_provider(torch.Tensor, lambda fqn, value: Gated(fqn, value))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step() -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()


train_step()
state = {"model": model.state_dict()}
expected = {k: v.clone() for k, v in state["model"].items()}
writer = DataStatesWriter(f"{root}/w", eager_copy_bytes=0)
response = dcp_datastates.async_save(state, writer, checkpoint_id=f"{root}/parent")
pid = os.fork()
if pid == 0:  # the child: its forward and step wait for no snapshot of the parent's
    train_step()
    try:
        dcp_datastates.async_save(state, writer, checkpoint_id=f"{root}/inherited")
        print("CHILD: the inherited writer saved", flush=True)
        os._exit(3)
    except WriterClosedError as exc:
        assert "os.fork()" in str(exc), exc
    gate.set()  # the child's own copy of the gate: its own saves copy at once
    mine = DataStatesWriter(f"{root}/c")
    dcp_datastates.async_save(
        {"w": torch.ones(3)}, mine, checkpoint_id=f"{root}/child"
    ).upload_completion.result(60)
    mine.close()
    writer.close()
    del writer
    gc.collect()
    sys.exit(0)  # atexit handlers and finalizers run
ended: list[tuple[int, int]] = []  # waitpid has no timeout: a thread waits, joined with one
waiter = threading.Thread(target=lambda: ended.append(os.waitpid(pid, 0)), daemon=True)
waiter.start()
waiter.join(60)
if not ended:
    os.kill(pid, 9)
    waiter.join()
    print("CHILD: hung", flush=True)
    sys.exit(4)
done = ended[0]
gate.set()
response.upload_completion.result(60)
loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
dcp.load(loaded, storage_reader=DataStatesReader(f"{root}/parent"), no_dist=True)
assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
child = {"w": torch.zeros(3)}
dcp.load(child, storage_reader=DataStatesReader(f"{root}/child"), no_dist=True)
assert torch.equal(child["w"], torch.ones(3))
writer.close()
print(f"OK child exit status {os.waitstatus_to_exitcode(done[1])}", flush=True)
