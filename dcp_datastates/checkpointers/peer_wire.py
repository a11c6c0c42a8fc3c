"""The wire under :mod:`.peers`: one set of files streamed from a rank to another over gloo (the
directories they land in: :mod:`.peer_replicas`).

A transfer is four exchanges on the replicator's own process group, each posted as non-blocking
sends and receives so that a ring (every rank sending to one rank and receiving from another, or
the same one) never waits on itself:

1. header   JSON: the files' names and sizes (and what else the caller adds), or why there are
            none (a file the sender could not stat);
2. chunks   the files' bytes as one stream cut into chunks of at most ``chunk_bytes``, two in
            flight each way (one on the wire, one being read or written), so a transfer holds
            ``4 * chunk_bytes`` whatever the state's size;
3. trailer  JSON: the CRC-32C of each file as read by the sender, or why reading failed (the
            sender then sends zeros for what it could not read, so both sides stay in step);
4. ack      JSON, the other way: whether the receiver wrote and verified everything.

A failure on either side's disk therefore reaches both sides as a reason and leaves the group
usable; only the transport failing (a peer died, a timeout) raises, and then the group's pairing
is lost for good.

May import: the leaves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from crc32c import crc32c

from .peer_replicas import FILE_MODE, check_names, make_private_dirs


# -- the stream's two ends --------------------------------------------------------------------
@dataclass
class Source:
    """The sender's files read in order as one stream, CRC-32C per file as read."""

    paths: list[Path]
    names: list[str]
    sizes: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)
    error: str | None = None
    current: str | None = None
    _index: int = 0
    _offset: int = 0
    _file: Any = None

    def __post_init__(self) -> None:
        try:
            self.sizes = [p.stat().st_size for p in self.paths]
        except OSError as e:
            self.sizes, self.error = [], f"cannot stat {e.filename}: {e.strerror}"
        self.crcs = [0] * len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def read_into(self, out: memoryview) -> None:
        """Fill ``out`` with the stream's next bytes (zeros past a failed read)."""
        done = 0
        while done < len(out):
            i = self._index
            self.current = self.names[i]
            want = min(len(out) - done, self.sizes[i] - self._offset)
            part = out[done : done + want]
            got = 0
            if self.error is None:
                try:
                    if self._file is None:
                        self._file = open(self.paths[i], "rb")  # noqa: SIM115 - closed below
                    got = self._file.readinto(part)
                    if got < want:
                        self.error = f"{self.paths[i]} shrank while it was sent"
                except OSError as e:
                    self.error = f"reading {self.paths[i]} failed: {e}"
            part[got:] = bytes(want - got)
            self.crcs[i] = crc32c(part, self.crcs[i])
            done += want
            self._offset += want
            if self._offset == self.sizes[i]:
                self.close()
                self._index, self._offset = i + 1, 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Sink:
    """The receiver's end: bytes written in order to temporary files in ``directory``, checked
    against the sender's CRCs (and ``expected`` ones, if given), renamed into place by
    :meth:`commit` only when every file is whole."""

    def __init__(
        self,
        directory: Path,
        names: Sequence[str],
        sizes: Sequence[int],
        *,
        temp_suffix: str,
        expected: Sequence[int] | None = None,
    ) -> None:
        self.directory, self.names, self.sizes = Path(directory), list(names), list(sizes)
        self.expected = list(expected) if expected is not None else None
        self.crcs = [0] * len(self.names)
        self.error: str | None = None
        self.current: str | None = None
        self._suffix = temp_suffix
        self._index = self._offset = 0
        self._fd: int | None = None
        try:
            check_names(self.names)
            make_private_dirs(self.directory)
        except (OSError, ValueError) as e:
            self.error = str(e)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def _temp(self, i: int) -> Path:
        return self.directory / f".{self.names[i]}{self._suffix}"

    def write(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            i = self._index
            self.current = self.names[i]
            take = min(len(data) - done, self.sizes[i] - self._offset)
            part = data[done : done + take]
            self.crcs[i] = crc32c(part, self.crcs[i])
            if self.error is None:
                try:
                    if self._fd is None:
                        self._temp(i).unlink(missing_ok=True)
                        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                        self._fd = os.open(self._temp(i), flags, FILE_MODE)
                    while part:
                        part = part[os.write(self._fd, part) :]
                except OSError as e:
                    self.error = f"writing {self._temp(i)} failed: {e}"
            done += take
            self._offset += take
            if self._offset == self.sizes[i]:
                self._close_file()
                self._index, self._offset = i + 1, 0

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finish(self, trailer: dict[str, Any]) -> str | None:
        """Check the stream against the sender's trailer; ``None`` if it is whole, else why not
        (temporary files removed)."""
        self._close_file()
        if self.error is None and trailer.get("error"):
            self.error = f"the sender failed: {trailer['error']}"
        if self.error is None:
            for i, name in enumerate(self.names):
                want = self.expected[i] if self.expected is not None else trailer["crcs"][i]
                if self.crcs[i] != trailer["crcs"][i] or self.crcs[i] != want:
                    self.error = (
                        f"{name} arrived with crc32c {self.crcs[i]:#010x}, not {want:#010x}"
                    )
                    break
                if self.sizes[i] == 0 and self.error is None:  # no chunk ever opened it
                    try:
                        self._temp(i).touch(mode=FILE_MODE, exist_ok=True)
                    except OSError as e:
                        self.error = f"writing {self._temp(i)} failed: {e}"
        if self.error is not None:
            self.discard()
        return self.error

    def commit(self) -> list[str]:
        """Rename the verified temporary files to their names; returns the names."""
        for i, name in enumerate(self.names):
            os.replace(self._temp(i), self.directory / name)
        return list(self.names)

    def discard(self) -> None:
        self._close_file()
        for i in range(len(self.names)):
            self._temp(i).unlink(missing_ok=True)

    def marker(self, **about: Any) -> dict[str, Any]:
        files = {
            n: {"size": s, "crc32c": c}
            for n, s, c in zip(self.names, self.sizes, self.crcs, strict=True)
        }
        return {**about, "files": files}


# -- the transport ------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one rank's transfer gave: the reasons it failed each way (``None``: it did not)."""

    sent_error: str | None = None
    received_error: str | None = None
    received: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    header: dict[str, Any] = field(default_factory=dict)


class Link:
    """Point-to-point messages on one gloo group (group ranks), every wait bounded by
    ``timeout``. ``where`` names the file in flight when the transport fails."""

    def __init__(self, group: Any, timeout: timedelta, chunk_bytes: int) -> None:
        self.group, self.timeout, self.chunk_bytes = group, timeout, chunk_bytes
        self.where: str | None = None
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def _wait(self, works: list[Any]) -> None:
        for w in works:
            w.wait(self.timeout)

    def _send(self, t: torch.Tensor, to: int) -> Any:
        return dist.isend(t, group=self.group, group_dst=to)

    def _recv(self, t: torch.Tensor, frm: int) -> Any:
        return dist.irecv(t, group=self.group, group_src=frm)

    def message(self, out: dict | None, to: int | None, frm: int | None) -> dict | None:
        """Send ``out`` (JSON) to ``to`` and receive one from ``frm``; either may be ``None``."""
        blob = json.dumps(out).encode() if to is not None else b""
        n_out, n_in = (
            torch.tensor([len(blob)], dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
        )
        works = [self._send(n_out, to)] if to is not None else []
        works += [self._recv(n_in, frm)] if frm is not None else []
        self._wait(works)
        inbox = torch.empty(int(n_in.item()), dtype=torch.uint8)
        works = (
            [self._send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), to)] if blob else []
        )
        works += [self._recv(inbox, frm)] if frm is not None and inbox.numel() else []
        self._wait(works)
        return json.loads(inbox.numpy().tobytes()) if frm is not None else None

    def _buffers(self) -> list[torch.Tensor]:
        """Two send and two receive buffers (pages are touched only by the ones used)."""
        if self._bufs is None:
            self._bufs = [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in range(4)]
        return self._bufs

    def release(self) -> None:
        """Drop the chunk buffers (they are kept between transfers while the replicator lives)."""
        self._bufs = None

    def stream(self, source: Source | None, to: int | None, sink: Sink | None, frm: int | None):
        """Send ``source``'s stream to ``to`` while receiving ``sink``'s from ``frm``, chunk by
        chunk, double-buffered: chunk k+1 is read, and chunk k-1 written, while chunk k is on
        the wire (gloo's threads move it)."""
        bufs = self._buffers()
        views = [memoryview(b.numpy()) for b in bufs]
        send_total = source.total if source is not None else 0
        recv_total = sink.total if sink is not None else 0
        sent = got = landed = k = 0
        inflight: list[Any] = []
        while True:
            n = min(self.chunk_bytes, send_total - sent)
            m = min(self.chunk_bytes, recv_total - got)
            out, into = k % 2, 2 + k % 2
            if n:  # overlaps the previous chunk's transfer
                source.read_into(views[out][:n])
            self._wait(inflight)
            inflight = []
            if n:
                self.where = f"sending {source.current}"
                inflight.append(self._send(bufs[out][:n], to))
            if m:
                inflight.append(self._recv(bufs[into][:m], frm))
            if landed:  # the previous chunk received: written while this one travels
                sink.write(views[2 + (k - 1) % 2][:landed])
                self.where = f"receiving {sink.current}"
            if not n and not m:
                break
            sent, got, landed, k = sent + n, got + m, m, k + 1
        if source is not None:
            source.close()
        return sent, got

    def transfer(
        self,
        source: Source | None,
        to: int | None,
        frm: int | None,
        make_sink: Callable[[dict[str, Any]], Sink] | None,
        header: dict[str, Any] | None = None,
        *,
        settle: Callable[[Sink], object] | None = None,
    ) -> tuple[Outcome, Sink | None]:
        """Stream ``source`` to ``to`` while receiving from ``frm`` into the sink ``make_sink``
        builds from the header received. Once the sink is verified whole, ``settle`` puts it in
        place (an ``OSError`` there counts as a failed receive) before the ack tells the sender."""
        outcome = Outcome()
        out_header = None
        if source is not None:
            out_header = {
                **(header or {}),
                "names": source.names if source.error is None else [],
                "sizes": source.sizes,
                "error": source.error,
            }
        self.where = "exchanging headers"
        in_header = self.message(out_header, to, frm)
        sink = None
        if in_header is not None:
            outcome.header = in_header
            sink = make_sink(in_header)
            if in_header.get("error") and sink.error is None:
                sink.error = f"the sender failed: {in_header['error']}"
        outcome.bytes_sent, outcome.bytes_received = self.stream(source, to, sink, frm)
        self.where = "exchanging trailers"
        trailer = None
        if source is not None:
            trailer = {"crcs": source.crcs, "error": source.error}
        in_trailer = self.message(trailer, to, frm)
        if sink is not None:
            outcome.received_error = sink.finish(in_trailer)
            if outcome.received_error is None and settle is not None:
                try:
                    settle(sink)
                except OSError as e:
                    outcome.received_error = f"putting the files in place failed: {e}"
                    sink.discard()
        self.where = "exchanging acks"
        ack = {"error": outcome.received_error} if sink is not None else None
        back = self.message(ack, frm, to)
        if back is not None:
            outcome.sent_error = back["error"]
        self.where = None
        return outcome, sink


__all__ = ["Link", "Outcome", "Sink", "Source"]
