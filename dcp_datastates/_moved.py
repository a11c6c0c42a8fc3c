"""Old import paths of modules that moved into subpackages keep working, with a warning.

``import dcp_datastates.writer`` (or ``from dcp_datastates.reader import DataStatesReader``)
gives the module at its new place, the very same module object, and warns once naming the new
path. Being the same object matters: a patch applied through the old name reaches the code that
runs, and a pickle naming an old path still unpickles.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Old module path (under ``dcp_datastates.``) -> new one.
MOVED = {
    "_cuda": "_platform.cuda",
    "_pages": "_platform.pages",
    "_signals": "_concurrency.signals",
    "dcp_future": "_concurrency.futures",
    "snapshot.latch": "_concurrency.latch",
    "snapshot.workers": "_concurrency.workers",
    "snapshot.priority": "_concurrency.priority",
    "localfile": "storage.localfile",
    "storage_s3": "storage.s3",
    "_s3_client": "storage._s3_client",
    "planner": "save.planner",
    "compat": "save.compat",
    "path_turns": "save.path_turns",
    "flush": "save.flush",
    "commit": "save.commit",
    "process_staging": "save.process_staging",
    "writer": "save.writer",
    "api": "save.api",
    "snapshot.runtime": "save.runtime",
    "snapshot.engine": "snapshot.session",
    "reader": "load.reader",
    "fetch": "load.fetch",
    "read_pool": "load.read_pool",
    "bounce": "load.bounce",
    "checksum": "load.checksum",
    "locate": "load.locate",
    "object_records": "load.object_records",
    "safety": "load.safety",
    "checkpointer": "checkpointers.checkpointer",
    "tiers": "checkpointers.tiers",
}

_PACKAGE = __name__.rpartition(".")[0]


def new_path(old: str) -> str | None:
    """The new dotted path of the old module ``old`` (a full dotted path), or None."""
    prefix = _PACKAGE + "."
    if not old.startswith(prefix) or old[len(prefix) :] not in MOVED:
        return None
    return prefix + MOVED[old[len(prefix) :]]


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module already at its new path (never a second copy)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old path's spec on the module: give it its own back.
        module.__spec__ = self.own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        new = new_path(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new}; import it from there (or the public names from "
            f"{_PACKAGE} itself). The old path will be removed in a later release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (before the file-system finders)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
