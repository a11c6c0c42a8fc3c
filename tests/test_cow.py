"""Copy-on-write: while a snapshot is in flight, a write on the saving thread to a tensor not
copied yet copies that tensor first, whatever path the write takes, and the save commits the
state at the call. Writes it cannot see (another thread, NumPy) still fail the save.

Every snapshot copy here waits for a gate the test opens after the write, so the write provably
lands while the tensor's snapshot is pending.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    EVENT_TIMEOUT_S,
    GatedTensorProvider,
    failure_of,
    load_like,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from dcp_datastates import (
    CheckpointSaveError,
    DataStatesReader,
    DataStatesWriter,
    SnapshotMutationError,
    async_save,
)
from dcp_datastates._platform import dispatch
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot import cow

N = 1 << 16  # float32 elements: 256 KiB, above eager_copy_bytes


@pytest.fixture
def gate(registered_providers: Any) -> Iterator[threading.Event]:
    """Copies of every ``nn.Parameter`` wait until the returned event is set."""
    event = threading.Event()
    registered_providers(nn.Parameter, lambda fqn, v: GatedTensorProvider(fqn, v, event))
    yield event
    event.set()


def _commits_the_call_state(tmp_path: Path, state: dict, at_call: dict, response: Any) -> None:
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    for reader in ("stock", "datastates"):
        loaded = load_like(tmp_path, state, reader)
        for key, value in at_call.items():
            assert torch.equal(loaded[key], value), (reader, key)


def _ema_like(w: torch.Tensor) -> None:
    w.data.mul_(0.5).add_(0.25)


def _no_grad_decay(w: torch.Tensor) -> None:
    with torch.no_grad():
        w.mul_(0.9)


WRITES = [
    pytest.param(lambda w: w.data.add_(1.0), id="data-add"),
    pytest.param(lambda w: w.data.copy_(torch.zeros(N)), id="data-copy"),
    pytest.param(_ema_like, id="data-ema-like"),
    pytest.param(lambda w: w.data.__setitem__(100, 7.0), id="data-unsampled-byte"),
    pytest.param(lambda w: w.data[10:20].fill_(3.0), id="view-fill"),
    pytest.param(
        lambda w: w.data.index_put_((torch.tensor([5, 500]),), torch.tensor([1.0, 2.0])),
        id="index-put",
    ),
    pytest.param(_no_grad_decay, id="no-grad-mul"),
    pytest.param(lambda w: torch._foreach_mul_([w.data], 2.0), id="foreach"),
    pytest.param(lambda w: torch.add(w.data, 1.0, out=w.data), id="out-argument"),
    pytest.param(lambda w: torch.from_numpy(w.detach().numpy()).sub_(1.0), id="from-numpy-op"),
]


@pytest.mark.parametrize("write", WRITES)
def test_a_write_the_mode_sees_is_copied_first_and_the_save_commits_the_call_state(
    tmp_path: Path, make_writer: Any, gate: threading.Event, write: Any
) -> None:
    weight = nn.Parameter(torch.randn(N), requires_grad=False)
    at_call = {"w": weight.detach().clone()}
    writer = make_writer(tmp_path, guard_optimizer_step=False)
    response = async_save({"w": weight}, writer, no_dist=True)
    assert cow.active()

    write(weight)
    assert not torch.equal(weight.detach(), at_call["w"]), "the write changed nothing"
    gate.set()

    _commits_the_call_state(tmp_path, {"w": torch.zeros(N)}, at_call, response)
    assert writer.last_stats.cow_bytes == weight.nbytes


def test_a_transposed_view_written_where_no_byte_is_sampled_commits_the_call_state(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    """Was the documented limitation: a write that misses every sampled byte of a strided
    tensor committed torn. The mode sees it whatever bytes it touches."""
    weight = nn.Parameter(torch.randn(64, 128).t(), requires_grad=False)
    at_call = {"w": weight.detach().clone()}
    response = async_save({"w": weight}, make_writer(tmp_path), no_dist=True)
    weight.data[0, 0] = 7.0
    gate.set()
    _commits_the_call_state(tmp_path, {"w": torch.zeros(128, 64)}, at_call, response)


def test_load_state_dict_right_after_the_save_commits_the_weights_at_the_call(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    best = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    state = {"model": model.state_dict(keep_vars=True)}
    at_call = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    response = async_save(state, make_writer(tmp_path, eager_copy_bytes=0), no_dist=True)
    model.load_state_dict(best)  # a rollback to the best weights: copy_ under no_grad
    gate.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    loaded = load_like(
        tmp_path, {"model": {k: torch.zeros_like(v) for k, v in best.items()}}, "stock"
    )
    for key, value in at_call.items():
        assert torch.equal(loaded["model"][key.removeprefix("model.")], value), key


def test_a_batchnorm_forward_without_the_forward_gate_is_copied_first(
    tmp_path: Path, make_writer: Any, registered_providers: Any
) -> None:
    """``native_batch_norm`` writes the running statistics without its schema saying so: the
    mode knows (``cow._UNMARKED``)."""
    gate = threading.Event()
    registered_providers(torch.Tensor, lambda fqn, v: GatedTensorProvider(fqn, v, gate))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64))
    model(torch.randn(16, 32))
    state = {"model": model.state_dict()}
    at_call = {k: v.clone() for k, v in state["model"].items()}
    writer = make_writer(tmp_path, guard_forward=False, eager_copy_bytes=0)
    response = async_save(state, writer, no_dist=True)
    model(torch.randn(16, 32))
    assert not torch.equal(model[1].running_mean, at_call["1.running_mean"])
    gate.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    loaded = load_like(tmp_path, {"model": at_call}, "datastates")["model"]
    for key, value in at_call.items():
        assert torch.equal(loaded[key], value), key
    assert writer.last_stats.cow_bytes >= 2 * 64 * 4  # the two running statistics


def test_a_load_through_our_reader_into_a_tensor_in_flight_commits_the_call_state(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    """Our reader writes its targets behind torch's back, on its own threads: it asks
    copy-on-write first, as stock's ``copy_`` on the caller's thread is seen by the mode."""
    big = 1 << 19  # 2 MiB: a record the reader reads in place
    weight = nn.Parameter(torch.zeros(big), requires_grad=False)
    other = torch.zeros(big)
    other[1000:2000] = 5.0
    dcp.save({"w": other}, storage_writer=DataStatesWriter(tmp_path / "other"), no_dist=True)
    at_call = {"w": weight.detach().clone()}
    response = async_save({"w": weight}, make_writer(tmp_path / "ckpt"), no_dist=True)
    dcp.load({"w": weight}, storage_reader=DataStatesReader(tmp_path / "other"), no_dist=True)
    assert torch.equal(weight.detach(), other)
    gate.set()
    _commits_the_call_state(tmp_path / "ckpt", {"w": torch.ones(big)}, at_call, response)


def test_a_write_from_another_thread_is_not_seen_and_fails_the_save(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    weight = nn.Parameter(torch.randn(N), requires_grad=False)
    response = async_save({"w": weight}, make_writer(tmp_path), no_dist=True)
    writer_thread = threading.Thread(target=lambda: weight.data.add_(1.0))
    writer_thread.start()
    writer_thread.join()
    gate.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert failure_of(raised.value, SnapshotMutationError) is not None, raised.value
    assert not (tmp_path / METADATA_NAME).exists()


def test_a_numpy_write_is_not_seen_and_fails_the_save_where_it_touches_a_sampled_byte(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    weight = nn.Parameter(torch.randn(N), requires_grad=False)
    response = async_save({"w": weight}, make_writer(tmp_path), no_dist=True)
    weight.detach().numpy()[:] = 7.0
    gate.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.unversioned, raised.value


class _ReadsInTwoHalves(TensorProvider):
    """A real provider whose copy of the live tensor reads its first half, lets the test write
    the tensor, then reads the second half: a copy torn by a write that started meanwhile."""

    halfway = threading.Event()
    resume = threading.Event()

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, start: int, stop: int) -> None:
        if src is not self.source:
            return super()._copy(src, dst, start, stop)
        middle = start + (stop - start) // 2
        super()._copy(src, dst[: middle - start], start, middle)
        self.halfway.set()
        assert self.resume.wait(EVENT_TIMEOUT_S)
        super()._copy(src, dst[middle - start :], middle, stop)


def test_a_write_that_lands_while_a_copy_reads_the_tensor_is_not_committed(
    tmp_path: Path, make_writer: Any, registered_providers: Any
) -> None:
    registered_providers(nn.Parameter, _ReadsInTwoHalves)
    _ReadsInTwoHalves.halfway.clear()
    _ReadsInTwoHalves.resume.clear()
    weight = nn.Parameter(torch.randn(N), requires_grad=False)
    at_call = {"w": weight.detach().clone()}
    writer = make_writer(tmp_path, guard_optimizer_step=False, live_flush=False)
    response = async_save({"w": weight}, writer, no_dist=True)
    assert _ReadsInTwoHalves.halfway.wait(EVENT_TIMEOUT_S)
    weight.data.fill_(9.0)  # copied first (the half already read is the same bytes)
    _ReadsInTwoHalves.resume.set()
    _commits_the_call_state(tmp_path, {"w": torch.zeros(N)}, at_call, response)


def test_the_mode_is_pushed_by_the_save_and_leaves_at_the_next_step_once_copied(
    tmp_path: Path, make_writer: Any
) -> None:
    cow.settle()
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    response = async_save({"model": model.state_dict()}, make_writer(tmp_path), no_dist=True)
    assert cow.active()
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # the guard waits for the snapshot; the step's post-hook pops the mode
    assert response.staging_completion.done()
    assert not cow.active()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        self.seen += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_the_caller_pushes_after_ours_keeps_its_place(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    """Ours leaves from under a mode entered inside the snapshot window: the caller's mode
    stays innermost, keeps counting, and pops itself at its exit."""
    weight = nn.Parameter(torch.randn(N), requires_grad=False)
    at_call = {"w": weight.detach().clone()}
    response = async_save({"w": weight}, make_writer(tmp_path), no_dist=True)
    with _Counting() as counting:
        weight.data.add_(1.0)
        gate.set()
        response.staging_completion.result(timeout=EVENT_TIMEOUT_S)
        assert cow.settle() and not cow.active()
        assert dispatch.stack() == [counting]
        before = counting.seen
        torch.ones(2).add_(1.0)
        assert counting.seen == before + 2
    assert dispatch.stack() == []
    _commits_the_call_state(tmp_path, {"w": torch.zeros(N)}, at_call, response)


@pytest.mark.parametrize(
    "mode",
    [_Counting, lambda: FlopCounterMode(display=False)],
    ids=["counting", "flop-counter"],
)
def test_a_mode_entered_before_the_save_and_left_after_it_pops_its_own(
    tmp_path: Path, make_writer: Any, mode: Any
) -> None:
    """A ``with FlopCounterMode():`` around a training step that saves: its exit pops the
    innermost mode, which must be its own (ours goes under it), and the next saves still copy
    on write (a user sweep: its exit popped ours, left its own pushed for good, and every later
    write failed the save)."""
    writer = make_writer(tmp_path, guard_optimizer_step=False, eager_copy_bytes=0)
    weight = torch.randn(N)
    for i in range(2):
        at_call = {"w": weight.clone()}
        with mode():
            response = async_save(
                {"w": weight}, writer, checkpoint_id=str(tmp_path / f"s{i}"), no_dist=True
            )
        assert dispatch.stack() == [] or cow.active() and len(dispatch.stack()) == 1
        with torch.no_grad():
            weight.mul_(2.0)
        _commits_the_call_state(tmp_path / f"s{i}", {"w": torch.zeros(N)}, at_call, response)
        cow.settle()
        assert dispatch.stack() == []


def test_without_copy_on_write_no_mode_is_pushed(tmp_path: Path, make_writer: Any) -> None:
    cow.settle()
    writer = make_writer(tmp_path, copy_on_write=False)
    response = async_save({"w": torch.randn(N)}, writer, no_dist=True)
    assert not cow.active()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)


@pytest.mark.parametrize("saves", [1, 3], ids=["walked", "replayed"])
def test_a_storage_swapped_after_the_call_leaves_the_snapshot_alone(
    tmp_path: Path, make_writer: Any, saves: int
) -> None:
    """``x.data = other`` and ``torch.utils.swap_tensors`` change no bytes: they give the
    caller's tensor object another storage, which copy-on-write cannot see. ``stage()`` aliases
    every tensor it records, so the snapshot keeps the storage of the call (a user sweep: a
    buffer saved with ``keep_vars=True`` and swapped right after committed the new values)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2048), nn.BatchNorm1d(2048))
    model(torch.randn(8, 64))
    plain = torch.randn(N)
    writer = make_writer(tmp_path, guard_optimizer_step=False)
    for i in range(saves):
        state = {"model": model.state_dict(keep_vars=True), "plain": plain}
        at_call = {
            "model": {k: v.detach().clone() for k, v in state["model"].items()},
            "plain": plain.clone(),
        }
        path = tmp_path / f"s{i}"
        response = async_save(state, writer, checkpoint_id=str(path), no_dist=True)
        model[1].running_mean.data = torch.randn(2048)  # a buffer, not a parameter
        model[0].weight.data = torch.randn(2048, 64)
        torch.utils.swap_tensors(plain, torch.randn(N))
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
        loaded = load_like(path, at_call, "stock")
        assert torch.equal(loaded["plain"], at_call["plain"])
        for key, value in at_call["model"].items():
            assert torch.equal(loaded["model"][key], value), (i, key)


def test_higher_order_operators_and_flex_attention_run_in_the_snapshot_window(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    """``torch.cond`` and FlexAttention are higher-order operators, and FlexAttention compiles
    its kernel with ``fullgraph=True`` even in eager mode: under a mode that takes neither
    (torch's default), both raised in the snapshot window."""
    from torch.nn.attention.flex_attention import flex_attention

    weight = nn.Parameter(torch.randn(N), requires_grad=False)
    at_call = {"w": weight.detach().clone()}
    response = async_save({"w": weight}, make_writer(tmp_path), no_dist=True)
    assert cow.active()
    q = torch.randn(1, 1, 128, 16)
    assert flex_attention(q, q, q).shape == q.shape
    assert torch.equal(
        torch.cond(torch.tensor(True), lambda x: x + 1, lambda x: x - 1, (q,)), q + 1
    )
    weight.data.add_(1.0)  # still copied first: the mode is on
    gate.set()
    _commits_the_call_state(tmp_path, {"w": torch.zeros(N)}, at_call, response)


def test_a_save_right_after_a_save_does_not_run_its_own_work_through_the_mode(
    tmp_path: Path, make_writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No forward or step between two saves leaves the first save's mode on the thread; the
    second ``stage()`` aliases and copies every tensor, and through the mode that cost 62 ms
    instead of 22 at 20,000 tensors. It pauses the mode instead."""
    writer = make_writer(tmp_path, eager_copy_bytes=64)
    state = {f"t{i}": torch.randn(64 if i % 2 else 8) for i in range(200)}
    first = async_save(state, writer, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    first.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert cow.active()  # nothing popped it: no forward, no step
    seen: list[str] = []
    through = cow._CopyOnWrite.__torch_dispatch__

    def counting(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(str(func))
        return through(self, func, types, args, kwargs)

    monkeypatch.setattr(cow._CopyOnWrite, "__torch_dispatch__", counting)
    second = async_save(state, writer, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert seen == [], seen[:5]
    assert cow.active()  # the second save's own mode
    second.upload_completion.result(timeout=EVENT_TIMEOUT_S)
