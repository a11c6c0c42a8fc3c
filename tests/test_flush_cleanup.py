"""A failed save leaves none of this rank's data files behind, not even one written whole before
another file failed: nothing will commit them, and a full device needs its space back."""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import DataStatesWriter, StorageWriteError
from dcp_datastates.format import DATA_SUFFIX
from dcp_datastates.storage.base import LocalStorage


class _SecondFileFailsAfterFirstCompletes(LocalStorage):
    def __init__(self, root: str, first_done: threading.Event) -> None:
        super().__init__(root)
        self.first_done = first_done

    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool) -> Iterator[Any]:
        with super().open_write(name, sync=sync) as f:
            if name.endswith(f"_1{DATA_SUFFIX}"):
                assert self.first_done.wait(30), "the first file never completed"
                raise OSError(errno.ENOSPC, "No space left on device", self.describe(name))
            yield f
        if name.endswith(f"_0{DATA_SUFFIX}"):
            self.first_done.set()


class _Writer(DataStatesWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        save = self._save()
        save.storage = _SecondFileFailsAfterFirstCompletes(save.storage.root, threading.Event())
        self.storage_used = save.storage
        return super().write_data(plan, planner)


def test_a_file_written_whole_is_removed_when_another_file_of_the_save_fails(
    tmp_path: Path,
) -> None:
    state = {f"w{i}": torch.full((256, 256), float(i)) for i in range(4)}
    writer = _Writer(tmp_path / "ckpt", flush_workers=2)
    try:
        with pytest.raises(CheckpointException) as raised:
            dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.storage_used.first_done.is_set()  # file 0 was whole before file 1 failed
    finally:
        writer.close()
    err = raised.value.failures[0][0]  # (exception, traceback)
    assert isinstance(err, StorageWriteError) and err.errno == errno.ENOSPC, repr(err)
    assert not list((tmp_path / "ckpt").glob(f"*{DATA_SUFFIX}"))
