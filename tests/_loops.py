"""The harness of the loops zoo (``test_loops_zoo.py``): run a training loop that saves several
times, each save followed at once by what the user does next, and judge every save.

A :class:`Loop` is a training loop as users write it: it builds its model and optimizers from a
fixed seed, trains one iteration at a time, names the state it saves, and does something right
after each save call (by default, the next training iteration). :func:`run_loop` runs it through
one entry point (:data:`ENTRIES`) with one writer reused for every save (or a writer per save),
keeps a copy of every tensor and object of the state taken at each call, waits for every save,
and reads each committed checkpoint back with stock's reader and ours. Checkpoints are removed
once read: only the verdicts are kept.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, READERS, MiB, assert_same_state, failure_of, load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import dcp_datastates
from dcp_datastates import DataStatesError, DataStatesWriter

STOCK = "stock"

#: How a loop's saves are made: by stock, or by ours through each entry point.
ENTRIES = (
    STOCK,  # dcp.async_save(checkpoint_id=): DCP makes a FileSystemWriter for each save
    "dcp.async_save",  # with one DataStatesWriter, reused
    "dcp_datastates.async_save",  # with one DataStatesWriter, reused
    "dcp.async_save, a writer per save",  # with a new DataStatesWriter for each save
)


class Loop:
    """One training loop. ``__init__`` builds it from a fixed seed; :meth:`train` runs one
    iteration; :meth:`state` is the state dict handed to the save; :meth:`after_save` is what
    the user does right after the save call returns."""

    #: Number of saves the loop makes.
    saves: ClassVar[int] = 6

    def __init__(self) -> None:
        torch.manual_seed(0)
        #: Inputs come from their own generator: every run of a loop sees the same batches.
        self.data = torch.Generator().manual_seed(1)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.data)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.data)

    def train(self) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def after_save(self) -> None:
        self.train()


# -- the state at the call -------------------------------------------------------------------------
def frozen(value: Any) -> Any:
    """``value`` at this instant: every tensor cloned (a Parameter as a plain tensor), every
    container and object copied, so that no later change to the live state reaches it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {key: frozen(item) for key, item in value.items()}
    if isinstance(value, list):
        return [frozen(item) for item in value]
    return copy.deepcopy(value)


def _is_leaf(value: Any) -> bool:
    """Whether DCP saves ``value`` as one item (``_traverse.traverse_state_dict``): anything but
    a mapping, and lists that hold no tensor, mapping or such list."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return all(
        not isinstance(item, torch.Tensor)
        and (not isinstance(item, (Mapping, list)) or _is_leaf(item))
        for item in value
    )


def target_like(value: Any) -> Any:
    """A load target with ``value``'s structure: zeroed tensors, ``None`` for every object that
    DCP saves as one item (``conftest.blank_like`` stops at lists of dicts, which DCP
    flattens: an optimizer's ``param_groups``)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, Mapping):
        return {key: target_like(item) for key, item in value.items()}
    if _is_leaf(value):
        return None
    return [target_like(item) for item in value]


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(state_bytes(v) for v in state)
    return 0


def small_pool(state: Any) -> dict[str, int]:
    """A host pool of about a quarter of the state (at least the 1 MiB minimum): the snapshot
    waits for the flush to free blocks, so it is still in flight while the loop goes on."""
    pool = max(MiB, state_bytes(state) // 4 // 4096 * 4096)
    return {"host_pool_bytes": pool, "chunk_bytes": 256 * 1024, "coalesce_bytes": 64 * 1024}


# -- the saves -------------------------------------------------------------------------------------
class _Saver:
    """One entry point of :data:`ENTRIES`, with the writer(s) it saves through."""

    def __init__(self, entry: str, root: Path, options: dict[str, int]) -> None:
        self.entry, self.options = entry, options
        self.writers: list[DataStatesWriter] = []
        if entry not in (STOCK, "dcp.async_save, a writer per save"):
            self.writers.append(DataStatesWriter(root, **options))

    def save(self, state: dict[str, Any], path: Path) -> tuple[Future[Any], Future[Any] | None]:
        """Start the save; returns its upload future and, for ours, its staging future."""
        if self.entry == STOCK:
            # Not one FileSystemWriter reused: reset() to the next save's path while the
            # previous save still ran, it left 1-2 of 6 saves without .metadata here, their
            # futures resolved all the same (torch 2.13).
            return dcp.async_save(state, checkpoint_id=str(path), no_dist=True), None
        if self.entry == "dcp_datastates.async_save":
            response = dcp_datastates.async_save(
                state, self.writers[0], checkpoint_id=str(path), no_dist=True
            )
            return response.upload_completion, response.staging_completion
        if self.entry == "dcp.async_save, a writer per save":
            writer = DataStatesWriter(path, **self.options)
            self.writers.append(writer)
            returned = dcp.async_save(state, storage_writer=writer, no_dist=True)
        else:
            writer = self.writers[0]
            returned = dcp.async_save(
                state, storage_writer=writer, checkpoint_id=str(path), no_dist=True
            )
        if isinstance(returned, AsyncSaveResponse):
            return returned.upload_completion, returned.staging_completion
        return returned, getattr(writer, "staging_future", None)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


@dataclass
class Save:
    """What became of one save: its failure, or for a committed one what each reader found."""

    index: int
    in_flight: bool | None  # the snapshot was still in flight when the call returned
    error: str | None = None
    differences: dict[str, str] = field(default_factory=dict)  # reader -> first difference

    @property
    def committed(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        if self.error is not None:
            return f"save {self.index}: failed: {self.error}"
        if self.differences:
            found = "; ".join(f"{r} reader: {d}" for r, d in self.differences.items())
            return f"save {self.index}: committed a state other than the call's ({found})"
        return f"save {self.index}: committed the call's state"


@dataclass
class Run:
    entry: str
    saves: list[Save]

    @property
    def committed(self) -> int:
        return sum(s.committed for s in self.saves)

    @property
    def wrong(self) -> list[Save]:
        return [s for s in self.saves if s.committed and s.differences]

    def summary(self) -> str:
        head = (
            f"{self.entry}: {self.committed} of {len(self.saves)} saves committed, "
            f"{len(self.wrong)} of them wrong"
        )
        if any(s.in_flight is not None for s in self.saves):
            in_flight = sum(bool(s.in_flight) for s in self.saves)
            head += f"; the snapshot was in flight as the call returned in {in_flight}"
        return "\n".join([head, *(f"  {s}" for s in self.saves)])


def _reason(exc: BaseException) -> str:
    """The error behind a failed save (one rank's failure inside DCP's wrapping), one line."""
    cause = failure_of(exc, DataStatesError) or exc
    for failure in getattr(cause, "failures", {}).values():  # DCP's CheckpointException
        cause = failure[0] if isinstance(failure, tuple) else failure
        break
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {text[:240]}"


def _judge(
    index: int, path: Path, expected: dict[str, Any], in_flight: bool | None, readers: tuple
) -> Save:
    save = Save(index, in_flight)
    for reader in readers:
        try:
            loaded = load(path, target_like(expected), reader)
            assert_same_state(expected, loaded)
        except AssertionError as exc:
            save.differences[reader] = str(exc).splitlines()[0] or "differs"
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            save.differences[reader] = f"load failed: {_reason(exc)}"
    return save


def run_loop(make: Callable[[], Loop], entry: str, root: Path) -> Run:
    """Run ``make()``'s loop, saving through ``entry`` into ``root``, and judge every save."""
    loop = make()
    loop.train()  # optimizers have state before the first save
    saver: _Saver | None = None
    pending = []
    try:
        for index in range(loop.saves):
            state = loop.state()
            expected = frozen(state)
            if saver is None:
                saver = _Saver(entry, root, small_pool(expected))
            path = root / f"save{index}"
            upload, staging = saver.save(state, path)
            in_flight = None if staging is None else not staging.done()
            loop.after_save()
            loop.train()
            pending.append((index, path, expected, upload, in_flight))
            del state
        saves = []
        for index, path, expected, upload, in_flight in pending:
            try:
                upload.result(timeout=EVENT_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
                if isinstance(exc, KeyboardInterrupt):
                    raise
                saves.append(Save(index, in_flight, error=_reason(exc)))
            else:
                # Stock's checkpoints are read by stock only: that ours reads them is
                # test_conformance's business, and this is the harness's own check.
                readers = READERS[:1] if entry == STOCK else READERS
                saves.append(_judge(index, path, expected, in_flight, readers))
            shutil.rmtree(path, ignore_errors=True)
    finally:
        for _, _, _, upload, _ in pending:  # an assertion above: let the rest end first
            if not upload.done():
                with contextlib.suppress(BaseException):  # reported above, or not judged
                    upload.result(timeout=EVENT_TIMEOUT_S)
        if saver is not None:
            saver.close()
    return Run(entry, saves)
