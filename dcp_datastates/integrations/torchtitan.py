"""TorchTitan integration: a ``CheckpointManager`` whose saves go through ``DataStatesWriter``.

Select it in a TorchTitan config (a ``config_registry`` function)::

    from dcp_datastates.integrations.torchtitan import use_datastates
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_datastates():
        return use_datastates(llama3_8b(), async_mode="async")

or build the config directly: ``checkpoint=DataStatesCheckpointManager.Config(...)``.

What changes against TorchTitan's own manager (see docs/torchtitan.md):

- ``async_mode="async"``: ``dcp_datastates.async_save`` (``dcp.async_save``'s steps with our
  writer as its stager, on the writer's reused save threads): the lazy snapshot replaces DCP's
  staging (the call returns in milliseconds, not after a full copy); only the next
  ``optimizer.step()`` may wait for the snapshot.
- ``async_mode="async_with_pinned_mem"``: no daemon process and no ``DefaultStager``: the same
  lazy snapshot into our reused host pool (pinned when CUDA is present), with
  ``maybe_wait_for_staging`` waiting for that snapshot.
- ``async_mode="disabled"``: ``dcp.save`` with our writer (streamed, checksummed, committed).
- Loads go through ``DataStatesReader`` (crc32c-verified; reads stock DCP checkpoints too).
- ``keep_latest_k`` counts only committed checkpoints and never the one in flight; a purged
  checkpoint loses its ``.metadata`` first, so a half-deleted one is never loaded.
- HF-format saves and loads (``last_save_in_hf``, ``initial_load_in_hf``) are TorchTitan's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from ..format import METADATA_NAME
from ..load.reader import DataStatesReader
from ..save.api import async_save
from ..save.writer import DataStatesWriter

_HF_INDEX = "model.safetensors.index.json"
logger = logging.getLogger(__name__)


class DataStatesCheckpointManager(CheckpointManager):
    """TorchTitan's ``CheckpointManager`` with saves through :class:`DataStatesWriter` and loads
    through :class:`DataStatesReader`; every other behaviour is TorchTitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        host_pool_bytes: int | None = None
        """Host memory for snapshots (default: sized to the rank's state, capped by RAM)."""

        flush_workers: int | None = None
        """Files each rank writes in parallel (default: ``DataStatesWriter``'s)."""

        sync_files: bool = True
        """fsync the data files and the commit record before a save reports durable."""

        verify_on_load: bool = True
        """Check every record's crc32c when loading."""

        trusted_load: bool = False
        """Load object items with full unpickling (only for checkpoints you trust)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.ds_config = config
        self._writer: DataStatesWriter | None = None
        self._in_flight_id: str | None = None
        self._purge_lock = threading.Lock()
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # TorchTitan builds a DefaultStager when `self.stager` is None; our writer is the
            # stager (and `_close` closes it), so that path never runs.
            self.stager = self._get_writer()

    def _get_writer(self) -> DataStatesWriter:
        if self._writer is None:
            options: dict[str, Any] = {"sync_files": self.ds_config.sync_files}
            for name in ("flush_workers", "host_pool_bytes"):
                if getattr(self.ds_config, name) is not None:
                    options[name] = getattr(self.ds_config, name)
            self._writer = DataStatesWriter(self.folder, **options)
        return self._writer

    # -- save ----------------------------------------------------------------------------------
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        if to_hf:  # the last save in HF safetensors: TorchTitan's own HF writer
            hf = super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
            self._purge_stale_checkpoints()  # TorchTitan does not purge after the last save
            return hf
        writer = self._get_writer()
        ret: Future | AsyncSaveResponse | None
        if async_mode == AsyncMode.ASYNC:
            # What dcp.async_save does with our writer as its own stager, on the writer's reused
            # save threads instead of a thread started per save; TorchTitan's async mode keeps a
            # plain Future (resolved once durable and committed) and never waits for staging.
            ret = async_save(
                state_dict, writer, checkpoint_id=checkpoint_id, process_group=self.pg
            ).upload_completion
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = async_save(state_dict, writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
            ret = None
        if ret is not None:
            self._in_flight_id = checkpoint_id
            done = ret.upload_completion if isinstance(ret, AsyncSaveResponse) else ret
            done.add_done_callback(lambda f, c=checkpoint_id: self._landed(c, f))
        else:
            self._purge_stale_checkpoints()
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _landed(self, checkpoint_id: str, fut: Future) -> None:
        """On DCP's save thread, once an async save ended: it is committed, so retention may
        now count it (TorchTitan purges only when a save starts)."""
        if self._in_flight_id == checkpoint_id:
            self._in_flight_id = None
        if fut.exception() is None:
            try:
                self._purge_stale_checkpoints()
            except Exception:  # retention must not turn a committed save into a failure
                logger.exception("purging old checkpoints after %s failed", checkpoint_id)

    # -- load ----------------------------------------------------------------------------------
    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        reader = DataStatesReader(
            checkpoint_id,
            verify=self.ds_config.verify_on_load,
            trusted=self.ds_config.trusted_load,
        )
        dcp.load(state_dict, storage_reader=reader)
        if MODEL in self.states:  # TorchTitan flattens the model's states into the dict
            self.states[MODEL].load_state_dict(state_dict)

    # -- retention -----------------------------------------------------------------------------
    def _committed(self, path: str) -> bool:
        return filesystem.isfile(filesystem.join(path, METADATA_NAME)) or filesystem.isfile(
            filesystem.join(path, _HF_INDEX)
        )

    def _purge_stale_checkpoints(self) -> None:
        """Keep the ``keep_latest_k`` newest *committed* checkpoints; the save in flight is
        neither counted nor touched (TorchTitan's own purge counts it, hence its k >= 2)."""
        with self._purge_lock:
            self._purge_committed()

    def _purge_committed(self) -> None:
        if not self._should_purge():
            return
        committed = []
        for name in filesystem.listdir(self.folder):
            m = re.fullmatch(r"step-(\d+)", name)
            path = filesystem.join(self.folder, name)
            if m and path != self._in_flight_id and self._committed(path):
                committed.append((int(m.group(1)), path))
        committed.sort()
        for _, path in committed[: -self.keep_latest_k]:
            if not filesystem.is_remote(path):  # uncommit first: never a half-deleted "valid" one
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(path, METADATA_NAME))
            self.purge_queue.put(path)

    def _close(self) -> None:
        if self.save_future is not None:  # an async save in flight commits before we close
            self.maybe_wait_for_saving()
        super()._close()  # in async_with_pinned_mem, `self.stager` is our writer: closed there
        if self._writer is not None and self._writer is not self.stager:
            self._writer.close()
        self._writer = None


def use_datastates(trainer_config: Any, **fields: Any) -> Any:
    """Return ``trainer_config`` with its ``checkpoint`` section replaced by a
    :class:`DataStatesCheckpointManager.Config` carrying the same settings (plus ``fields``)."""
    current = trainer_config.checkpoint
    base = {
        f.name: getattr(current, f.name)
        for f in dataclasses.fields(current)
        if f.init and f.name in {g.name for g in dataclasses.fields(CheckpointManager.Config)}
    }
    base.update(fields)
    trainer_config.checkpoint = DataStatesCheckpointManager.Config(**base)
    return trainer_config
