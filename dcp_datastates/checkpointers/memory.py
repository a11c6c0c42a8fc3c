"""The memory tier: a directory on a memory-backed file system that outlives the process.

A :class:`~dcp_datastates.Checkpointer` with ``memory=MemoryTier(...)`` writes each save there
first, as a plain DCP checkpoint in our format, and commits it there (``.metadata`` last, as on
disk); a background flush then copies it to the durable root (``memflush.py``). A process
killed after the memory commit leaves a complete, checksummed checkpoint in memory; the
restarted process loads it at memory speed and finishes its flush.

Layout (one *segment* per job and node)::

    <base>/dcp_datastates-<user>-<job>/          0700, owned by this user
        segment.json                             uid, job, durable root, world size
        node_<node>/step_00000100/               a DCP checkpoint (this node's ranks' files,
                                                 plus the shared .metadata and manifest)
        node_<node>/rank_<r>.pid                 the pids using it (liveness, for the CLI)

``<base>`` is ``/dev/shm`` by default (a tmpfs: its pages count against the container's memory
limit, ``docs/storage.md``). ``<job>`` is the ``job_id`` given, else a hash of the durable root:
the same root restarted finds the same segment, another root never reads it. A segment owned by
another uid, with group or other permissions, or whose ``segment.json`` names another job or
another durable root is never read (and never written): the checkpointer says why and runs on
the durable tier alone.

May import: ``load``, ``storage`` and the leaves.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any

from ..format import METADATA_NAME
from ..load.safety import load_metadata
from . import steps

logger = logging.getLogger(__name__)

PREFIX = "dcp_datastates-"
SEGMENT_FILE = "segment.json"
_PID = re.compile(r"^rank_(\d+)\.pid$")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, kw_only=True)
class MemoryTier:
    """Where and how much a :class:`~dcp_datastates.Checkpointer` keeps in host memory.

    Attributes:
        base: A directory on a memory-backed file system (default ``/dev/shm``); the segment is
            made under it.
        job_id: Names the segment; a restart must give the same one (default: a hash of the
            checkpointer's durable root).
        node: This process's node (default: ``$DCP_DATASTATES_NODE``, else the host name). Ranks
            of one node share one directory; give each simulated node its own.
        keep: Committed steps kept in memory (1 or more). Memory holds at most ``keep + 1``
            copies of the state's bytes of this node's ranks: ``keep`` committed and the one
            being written; a save waits for the oldest one's flush to disk when it would hold
            more.
        peer_distance: 0 (off), or copy each rank's files of every step to the rank of the same
            local index this many nodes further round the ring of nodes
            (:class:`~dcp_datastates.checkpointers.peers.PeerReplicator`), so that a restart
            that lost a node's memory gets its files back. Costs each node one more copy of
            another node's bytes per step kept.
    """

    base: str = "/dev/shm"
    job_id: str | None = None
    node: str | None = None
    keep: int = 1
    peer_distance: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ValueError(f"MemoryTier(keep={self.keep!r}) must be an int of at least 1")
        d = self.peer_distance
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"MemoryTier(peer_distance={d!r}) must be an int >= 0 (0: off)")
        if not isinstance(self.base, str) or not os.path.isabs(self.base):
            raise ValueError(f"MemoryTier(base={self.base!r}) must be an absolute directory")
        for name in ("job_id", "node"):
            value = getattr(self, name)
            bad = not isinstance(value, str) or not value or _SAFE.search(value)
            if value is not None and bad:
                raise ValueError(
                    f"MemoryTier({name}={value!r}) must be a non-empty string of letters, "
                    "digits, '_', '.' and '-'"
                )


def job_key(tier: MemoryTier, durable_root: str) -> str:
    if tier.job_id is not None:
        return tier.job_id
    where = os.path.realpath(durable_root).encode()
    return "root" + hashlib.blake2b(where, digest_size=6).hexdigest()


def node_name(tier: MemoryTier) -> str:
    node = tier.node or os.environ.get("DCP_DATASTATES_NODE") or socket.gethostname()
    return _SAFE.sub("_", node)


def segment_path(base: str, job: str) -> str:
    return os.path.join(base, f"{PREFIX}{getpass.getuser()}-{job}")


def why_unusable(
    segment: str, job: str | None, durable_root: str | None = None, *, made: bool = True
) -> str | None:
    """Why ``segment`` must not be read by this user's job ``job`` saving to ``durable_root``
    (None: it may). ``job`` None checks only owner and permissions (the CLI). ``made`` False:
    a segment without its ``segment.json`` yet may be one another rank is making."""
    try:
        st = os.lstat(segment)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{segment} is not a directory"
    if st.st_uid != os.getuid():
        return f"{segment} is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{segment} has mode {stat.S_IMODE(st.st_mode):o}: others may read or change it"
    info = read_info(segment)
    if info is None and not made:
        return None
    if info is None:
        return f"{segment} has no readable {SEGMENT_FILE}"
    if info.get("uid") != os.getuid():
        return f"{segment}/{SEGMENT_FILE} names uid {info.get('uid')}"
    if job is not None and info.get("job") != job:
        return f"{segment} belongs to job {info.get('job')!r}, not {job!r}"
    theirs = info.get("durable_root")
    if durable_root is not None and (
        not isinstance(theirs, str) or os.path.realpath(theirs) != os.path.realpath(durable_root)
    ):
        return (
            f"{segment} holds the checkpoints of root {theirs}, not {durable_root} (two "
            "checkpointers given one job_id: give each its own; a dead job's goes with "
            "`dcp-datastates memory clean`)"
        )
    return None


def read_info(segment: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(segment, SEGMENT_FILE)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


class Segment:
    """This job's segment and this node's directory in it, as one rank uses them."""

    def __init__(self, tier: MemoryTier, durable_root: str, rank: int, world: int) -> None:
        self.tier = tier
        self.job = job_key(tier, durable_root)
        self.path = segment_path(tier.base, self.job)
        self.node = node_name(tier)
        self.root = os.path.join(self.path, f"node_{self.node}")
        self.rank, self.world = rank, world
        self.problem = why_unusable(self.path, self.job, durable_root, made=False)
        self.saved_world: int | None = None
        if self.problem is not None:
            return
        old = os.umask(0o077)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            info = read_info(self.path)
            if info is None:
                _put_json(self.path, SEGMENT_FILE, self._info(durable_root))
            else:
                self.saved_world = info.get("world_size")
            with open(os.path.join(self.root, f"rank_{rank}.pid"), "w") as f:
                f.write(f"{os.getpid()}\n")
        except OSError as exc:
            self.problem = f"cannot make {self.root}: {exc}"
            return
        finally:
            os.umask(old)
        self.problem = why_unusable(self.path, self.job, durable_root)  # made meanwhile?

    def _info(self, durable_root: str) -> dict[str, Any]:
        return {
            "uid": os.getuid(),
            "job": self.job,
            "durable_root": os.path.abspath(durable_root),
            "world_size": self.world,
            "created": time.time(),
        }

    @property
    def usable(self) -> bool:
        return self.problem is None

    def step_path(self, step: int) -> str:
        return steps.path(self.root, step)

    def claim_world(self, durable_root: str) -> None:
        """Record this run's world size (after a load read the memory tier, or passed it over)."""
        if self.usable and self.saved_world != self.world:
            _put_json(self.path, SEGMENT_FILE, self._info(durable_root))
            self.saved_world = self.world

    def committed_steps(self) -> list[int]:
        return sorted(s for s, ok in steps.listing(self.root).items() if ok)

    def missing_files(self, step: int) -> list[str]:
        """Data files ``step``'s ``.metadata`` names that this node's directory lacks."""
        place = self.step_path(step)
        return [n for n in data_files(place) if not os.path.exists(os.path.join(place, n))]

    def own_steps(self) -> list[int]:
        """Committed steps whose data files written by this rank are all here."""
        prefix = f"__{self.rank}_"
        held = []
        for step in self.committed_steps():
            try:
                names = [n for n in data_files(self.step_path(step)) if n.startswith(prefix)]
            except Exception:
                continue
            if all(os.path.exists(os.path.join(self.step_path(step), n)) for n in names):
                held.append(step)
        return held

    def replica_steps(self) -> list[int]:
        """Steps of which this node holds another rank's peer replica."""
        found = set()
        peer = os.path.join(self.root, "peer")
        for source in _names(peer):
            for name in _names(os.path.join(peer, source)):
                if (m := re.match(r"^step_(\d+)$", name)) is not None:
                    found.add(int(m.group(1)))
        return sorted(found)

    def delete_replicas(self, *, after: int | None) -> None:
        """The peer replicas this node holds of steps newer than ``after`` (None: all)."""
        peer = os.path.join(self.root, "peer")
        for source in _names(peer):
            for name in _names(os.path.join(peer, source)):
                m = re.match(r"^step_(\d+)$", name)
                if m is not None and (after is None or int(m.group(1)) > after):
                    shutil.rmtree(os.path.join(peer, source, name), ignore_errors=True)

    def bytes_held(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def delete_step(self, step: int) -> None:
        place = self.step_path(step)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(place, METADATA_NAME))  # uncommitted first
        shutil.rmtree(place, ignore_errors=True)

    def drop_uncommitted(self) -> None:
        """Step directories a crash left half written (nothing writes them now)."""
        for step in steps.plain_uncommitted(self.root):
            logger.info("rank %d: deleting %s, never committed", self.rank, self.step_path(step))
            shutil.rmtree(self.step_path(step), ignore_errors=True)

    def remove(self) -> None:
        """A clean exit: this rank's pid file; the node's directory once no rank uses it, and
        the segment once no node does."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.root, f"rank_{self.rank}.pid"))
        if any(_PID.match(n) for n in _names(self.root)):
            return
        shutil.rmtree(self.root, ignore_errors=True)
        if not any(n.startswith("node_") for n in _names(self.path)):
            shutil.rmtree(self.path, ignore_errors=True)


def data_files(place: str) -> list[str]:
    """The data files the ``.metadata`` in ``place`` names."""
    with open(os.path.join(place, METADATA_NAME), "rb") as f:
        metadata = load_metadata(f, os.path.join(place, METADATA_NAME))
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _put_json(directory: str, name: str, value: dict[str, Any]) -> None:
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(directory, name))


# -- the CLI's view --------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def segments(base: str = "/dev/shm") -> list[dict[str, Any]]:
    """This user's segments under ``base``: path, job, bytes, live pids, committed steps per
    node, and why one is not usable (None if it is)."""
    found = []
    prefix = f"{PREFIX}{getpass.getuser()}-"
    for name in sorted(_names(base)):
        if not name.startswith(prefix):
            continue
        path = os.path.join(base, name)
        info = read_info(path) or {}
        pids, nodes, size = [], {}, 0
        for node in _names(path):
            node_dir = os.path.join(path, node)
            if not node.startswith("node_") or not os.path.isdir(node_dir):
                continue
            for entry in _names(node_dir):
                if _PID.match(entry) is not None:
                    with (
                        contextlib.suppress(OSError, ValueError),
                        open(os.path.join(node_dir, entry)) as f,
                    ):
                        pids.append(int(f.read().strip()))
            nodes[node[5:]] = sorted(s for s, ok in steps.listing(node_dir).items() if ok)
            for dirpath, _, files in os.walk(node_dir):
                for f in files:
                    with contextlib.suppress(OSError):
                        size += os.lstat(os.path.join(dirpath, f)).st_size
        found.append(
            {
                "path": path,
                "job": info.get("job", name[len(prefix) :]),
                "durable_root": info.get("durable_root"),
                "bytes": size,
                "live_pids": [p for p in pids if _alive(p)],
                "steps": nodes,
                "problem": why_unusable(path, None),
            }
        )
    return found


def remove_segment(path: str) -> None:
    """Delete one of this user's segments (the CLI's ``clean``)."""
    problem = why_unusable(path, None)
    if problem is not None and "owned by uid" in problem:
        raise PermissionError(problem)
    shutil.rmtree(path)
