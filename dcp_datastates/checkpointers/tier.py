"""A tier: one place checkpoints live (a directory or URL, with its retention), the path of
each step in it, and the steps it holds committed. Used by
:class:`~dcp_datastates.checkpointers.tiers.TieredCheckpointer`.

May import: ``storage`` and the leaves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..format import METADATA_NAME
from ..storage.base import Storage, storage_for

_STEP = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True, kw_only=True)
class Tier:
    """One place checkpoints live, fastest first in
    :class:`~dcp_datastates.checkpointers.tiers.TieredCheckpointer`.

    Attributes:
        url: Root directory or URL; each step is ``<url>/step-<n>``.
        keep: Committed checkpoints kept (the newest ones); ``None`` keeps all.
        storage_options: fsspec options for a URL (endpoint, credentials, ...).
    """

    url: str
    keep: int | None = None
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ValueError(f"keep={self.keep!r} must be None or an int of at least 1")

    def path(self, step: int) -> str:
        return f"{self.url.rstrip('/')}/step-{step}"

    def storage(self, step: int | None = None) -> Storage:
        where = self.url if step is None else self.path(step)
        return storage_for(where, self.storage_options)

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint here, oldest first (listed fresh)."""
        steps = []
        for name in self.storage().list_names():
            match = _STEP.match(name)
            if match and self.storage(int(match.group(1))).exists(METADATA_NAME):
                steps.append(int(match.group(1)))
        return sorted(steps)
