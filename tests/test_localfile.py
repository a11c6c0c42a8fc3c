"""Local data files written with ``O_DIRECT`` through an aligned buffer (``localfile.py``): the
bytes on disk are exactly the bytes written, whatever their sizes and alignment, and a file
system that refuses direct I/O (at open or at a write) still gets every byte."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dcp_datastates.storage import localfile
from dcp_datastates.storage.base import LocalStorage
from dcp_datastates.storage.localfile import ALIGN, DIRECT_BUFFER, DirectFile


def _pieces(seed: int) -> list[Any]:
    """What a flush writes: small ``bytes`` heads and tails around large writable memoryviews of
    a pool (numpy), in sizes that cross the buffer's end, and an empty write."""
    rng = random.Random(seed)
    sizes = [7, 0, ALIGN, ALIGN - 1, DIRECT_BUFFER - 5, 300, DIRECT_BUFFER + 3, 65537, 12]
    sizes += [rng.randrange(1, 3 << 20) for _ in range(4)]
    pieces: list[Any] = []
    for i, n in enumerate(sizes):
        data = np.random.default_rng(seed + i).integers(0, 256, n, dtype=np.uint8)
        pieces.append(memoryview(data) if i % 2 else data.tobytes())
    return pieces


def _flags(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _direct_or_skip(path: Path) -> None:
    f = DirectFile.open(str(path))
    if f is None:
        pytest.skip(f"{path.parent} refuses O_DIRECT: the page-cache path is the one used there")
    f.close()


def test_a_data_file_holds_exactly_the_bytes_written_and_is_written_directly(
    tmp_path: Path,
) -> None:
    _direct_or_skip(tmp_path / "probe")
    storage = LocalStorage(tmp_path)
    pieces = _pieces(1)
    with storage.open_write("data.bin", sync=True) as f:
        assert _flags(f.fileno()) & os.O_DIRECT  # the fast path is the one taken here
        for piece in pieces:
            assert f.write(piece) == len(memoryview(piece).cast("B"))

    expected = b"".join(bytes(p) for p in pieces)
    assert len(expected) % ALIGN  # an unaligned end: written after O_DIRECT is switched off
    assert (tmp_path / "data.bin").read_bytes() == expected


@pytest.mark.parametrize("total", [0, 1, ALIGN, DIRECT_BUFFER, 2 * DIRECT_BUFFER + ALIGN + 1])
def test_files_of_edge_sizes_round_trip(tmp_path: Path, total: int) -> None:
    data = os.urandom(total)
    with LocalStorage(tmp_path).open_write("edge.bin", sync=True) as f:
        f.write(memoryview(bytearray(data)))
    assert (tmp_path / "edge.bin").read_bytes() == data


def test_a_file_system_that_refuses_o_direct_at_open_gets_a_buffered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open
    refused: list[str] = []

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            refused.append(os.fspath(path))
            raise OSError(errno.EINVAL, "Invalid argument", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(localfile.os, "open", no_direct)
    pieces = _pieces(2)
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        assert not isinstance(f, DirectFile)
        for piece in pieces:
            f.write(piece)

    assert refused == [str(tmp_path / "data.bin")]
    assert (tmp_path / "data.bin").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_a_direct_write_refused_midway_finishes_the_file_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _direct_or_skip(tmp_path / "probe")
    real_write = os.write
    direct_writes: list[int] = []

    def refuse_second_direct_write(fd: int, data: Any) -> int:
        if _flags(fd) & os.O_DIRECT:
            direct_writes.append(len(data))
            if len(direct_writes) == 2:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(localfile.os, "write", refuse_second_direct_write)
    pieces = _pieces(3)
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        for piece in pieces:
            f.write(piece)
        assert not _flags(f.fileno()) & os.O_DIRECT

    assert len(direct_writes) == 2  # one went through directly, then none were tried
    assert (tmp_path / "data.bin").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_unsynced_files_stay_in_the_page_cache_and_atomic_records_round_trip(
    tmp_path: Path,
) -> None:
    storage = LocalStorage(tmp_path)
    with storage.open_write("nosync.bin", sync=False) as f:
        assert not isinstance(f, DirectFile)
        f.write(b"abc")
    storage.put_atomic("record", b"committed", sync=True)  # shorter than one aligned block
    storage.put_atomic("big", b"m" * (3 * ALIGN + 5), sync=True)  # aligned part, then the rest
    assert (tmp_path / "nosync.bin").read_bytes() == b"abc"
    assert (tmp_path / "record").read_bytes() == b"committed"
    assert (tmp_path / "big").read_bytes() == b"m" * (3 * ALIGN + 5)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failed_block_removes_the_direct_file_and_returns_its_buffer(tmp_path: Path) -> None:
    _direct_or_skip(tmp_path / "probe")
    storage = LocalStorage(tmp_path)
    spare_before = len(localfile._spare)
    with (
        pytest.raises(RuntimeError, match="device gone"),
        storage.open_write("d.bin", sync=True) as f,
    ):
        f.write(os.urandom(DIRECT_BUFFER + 10))
        raise RuntimeError("device gone")
    assert not (tmp_path / "d.bin").exists()
    assert len(localfile._spare) == max(spare_before, 1)  # its buffer came back for reuse


def test_writes_after_flush_go_through_the_page_cache_in_order(tmp_path: Path) -> None:
    _direct_or_skip(tmp_path / "probe")
    head, more = os.urandom(2 * ALIGN), os.urandom(ALIGN + 3)  # an aligned end, then not
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        f.write(head)
        f.flush()
        assert not _flags(f.fileno()) & os.O_DIRECT
        f.write(more)
    assert (tmp_path / "data.bin").read_bytes() == head + more


def test_closing_a_writer_releases_the_direct_write_buffers(tmp_path: Path) -> None:
    _direct_or_skip(tmp_path / "probe")
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    writer = DataStatesWriter(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(3 * DIRECT_BUFFER // 8, dtype=torch.int64)}, storage_writer=writer)
    assert localfile._spare, "a direct-written save keeps its buffers for the next one"
    writer.close()
    assert localfile._spare == []


@pytest.mark.parametrize("direct", [True, False])
def test_direct_writes_option_decides_how_data_files_are_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    _direct_or_skip(tmp_path / "probe")
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter

    opened: list[str] = []
    real_open = DirectFile.open.__func__

    def counting_open(cls: type, path: str) -> DirectFile | None:
        opened.append(path)
        return real_open(cls, path)

    monkeypatch.setattr(DirectFile, "open", classmethod(counting_open))
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    writer = DataStatesWriter(tmp_path / "ckpt", direct_writes=direct)
    dcp.save(state, storage_writer=writer)
    writer.close()
    data_files = [p for p in opened if p.endswith(".distcp")]
    assert bool(data_files) is direct, opened
    back = {"w": torch.zeros(1 << 20)}
    dcp.load(back, storage_reader=DataStatesReader(tmp_path / "ckpt"))
    assert torch.equal(back["w"], state["w"])


def _resident_pages(buf: Any) -> int:
    """Pages of ``buf`` that are in memory (``mincore``), to see that it was faulted in."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = (len(buf) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(buf)), vec) == 0
    return sum(v & 1 for v in vec)


def test_warm_up_maps_and_faults_in_one_direct_buffer_per_flush_file(tmp_path: Path) -> None:
    _direct_or_skip(tmp_path / "probe")
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    localfile.release_spare_buffers()
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    writer = DataStatesWriter(tmp_path / "ckpt", flush_workers=3)
    writer.warm_up(state, wait=True)
    prepared = list(localfile._spare)
    assert len(prepared) == 3
    for buf in prepared:  # every page is in memory already: the first save takes no fault
        assert _resident_pages(buf) == DIRECT_BUFFER // mmap.PAGESIZE
    dcp.save(state, storage_writer=writer, checkpoint_id=tmp_path / "ckpt")
    assert {id(b) for b in localfile._spare} <= {id(b) for b in prepared}  # reused, none new
    writer.close()
    assert localfile._spare == []


def test_warm_up_that_cannot_map_a_direct_buffer_says_what_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _direct_or_skip(tmp_path / "probe")
    import torch

    from dcp_datastates import DataStatesWriter

    localfile.release_spare_buffers()
    real_mmap, maps = mmap.mmap, []

    def second_map_fails(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        if length == DIRECT_BUFFER:  # the pool's own mapping (another size) goes through
            if maps:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
            maps.append(length)
        return real_mmap(fileno, length, *args, **kwargs)

    monkeypatch.setattr(localfile.mmap, "mmap", second_map_fails)
    writer = DataStatesWriter(tmp_path / "ckpt", flush_workers=2, host_pool_bytes=1 << 20)
    try:
        with pytest.raises(OSError) as raised:
            writer.warm_up({"w": torch.zeros(16)}, wait=True)
        assert raised.value.errno == errno.ENOMEM
        message = str(raised.value)
        assert "direct-write buffer 2 of 2" in message and "Cannot allocate memory" in message
        assert "flush_workers" in message
    finally:
        monkeypatch.undo()
        writer.close()
    assert localfile._spare == []


def test_warm_up_prepares_no_direct_buffer_where_files_are_not_written_directly(
    tmp_path: Path,
) -> None:
    import torch

    from dcp_datastates import DataStatesWriter

    localfile.release_spare_buffers()
    state = {"w": torch.zeros(16)}
    for writer in (
        DataStatesWriter(tmp_path / "a", direct_writes=False),
        DataStatesWriter(tmp_path / "b", sync_files=False),
        DataStatesWriter("memory://warm-up-no-direct"),
    ):
        writer.warm_up(state, wait=True)
        assert localfile._spare == [], writer.path
        writer.close()


def test_populate_write_faults_in_exactly_the_pages_of_an_unaligned_range() -> None:
    from dcp_datastates._platform.pages import populate_write

    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 16 * page)
    assert _resident_pages(buf) == 0  # fresh anonymous memory: nothing faulted in yet
    if not populate_write(buf, 3 * page + 100, 2 * page):  # pages 3, 4 and 5
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _resident_pages(buf) == 3
    assert populate_write(buf)
    assert _resident_pages(buf) == 16
    buf.close()


# -- write_external: a tensor's bytes written from where they lie (the pool) -------------------
def _aligned_block(nbytes: int, seed: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned memory holding ``nbytes`` random bytes (as a pool block is)."""
    buf = mmap.mmap(-1, max(nbytes, 1))
    view = memoryview(buf)[:nbytes]
    view[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return buf, view


def test_aligned_memory_at_an_aligned_file_offset_is_written_without_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _direct_or_skip(tmp_path / "probe")
    copied: list[int] = []
    real_memmove = localfile.ctypes.memmove

    def counting_memmove(dst: int, src: int, n: int) -> Any:
        copied.append(n)
        return real_memmove(dst, src, n)

    monkeypatch.setattr(localfile.ctypes, "memmove", counting_memmove)
    head = os.urandom(ALIGN - 100)
    pad = bytes(100)
    blocks = [_aligned_block(n, i) for i, n in enumerate([3 << 20, (5 << 20) + 17, 1 << 20])]
    released: list[int] = []
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        f.write(head)
        assert not f.aligned()
        f.write(pad)
        assert f.aligned()
        for i, (_, view) in enumerate(blocks):
            assert f.write_external(view, lambda i=i: released.append(i))
            f.write(b"tail%d" % i)
            f.write(bytes(-(len(b"tail%d" % i) + view.nbytes) % ALIGN))  # the next one aligned
        assert released == []  # queued: the blocks are held until their bytes are written
    assert released == [0, 1, 2]
    expected = head + pad
    for i, (_, view) in enumerate(blocks):
        expected += bytes(view) + b"tail%d" % i + bytes(-(len(b"tail%d" % i) + view.nbytes) % ALIGN)
    assert (tmp_path / "data.bin").read_bytes() == expected
    assert max(copied, default=0) < 64 << 10  # no block went through the buffer's memmove


def test_write_external_declines_what_it_cannot_write_directly(tmp_path: Path) -> None:
    _direct_or_skip(tmp_path / "probe")
    buf, view = _aligned_block(2 << 20, 7)
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        f.write(b"x")  # the file is not on a block boundary
        assert not f.write_external(view, lambda: None)
        f.write(bytes(ALIGN - 1))
        assert not f.write_external(view[1:], lambda: None)  # the memory is not aligned
        assert not f.write_external(memoryview(bytes(2 << 20)), lambda: None)  # read-only
        assert not f.write_external(view[: ALIGN - 1], lambda: None)  # not one whole block
    assert (tmp_path / "data.bin").read_bytes() == b"x" + bytes(ALIGN - 1)


def test_a_direct_writev_refused_midway_finishes_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _direct_or_skip(tmp_path / "probe")
    real_writev = os.writev
    calls: list[bool] = []

    def refuse_direct(fd: int, segments: Any) -> int:
        calls.append(bool(_flags(fd) & os.O_DIRECT))
        if calls[-1]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_writev(fd, segments)

    monkeypatch.setattr(localfile.os, "writev", refuse_direct)
    _, view = _aligned_block(2 << 20, 8)
    released: list[bool] = []
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        f.write(bytes(ALIGN))
        assert f.write_external(view, lambda: released.append(True))
        f.write(b"end")
    assert calls == [True, False] and released == [True]
    assert (tmp_path / "data.bin").read_bytes() == bytes(ALIGN) + bytes(view) + b"end"


def test_a_file_closed_on_an_error_releases_what_it_queued(tmp_path: Path) -> None:
    _direct_or_skip(tmp_path / "probe")
    _, view = _aligned_block(2 << 20, 9)
    released: list[bool] = []
    storage = LocalStorage(tmp_path)
    with pytest.raises(RuntimeError, match="flush failed"), storage.open_write("d", sync=True) as f:
        assert f.write_external(view, lambda: released.append(True))
        raise RuntimeError("flush failed")
    assert released == [True]
    assert not (tmp_path / "d").exists()


def test_big_tensors_are_written_from_the_pool_at_aligned_offsets_and_load_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.format import MANIFEST_NAME, decode_manifest

    _direct_or_skip(tmp_path / "probe")
    taken: list[int] = []
    real = DirectFile.write_external

    def counting(self: DirectFile, data: memoryview, release: Any) -> bool:
        ok = real(self, data, release)
        if ok:
            taken.append(data.nbytes)
        return ok

    monkeypatch.setattr(DirectFile, "write_external", counting)
    torch.manual_seed(0)
    # Big tensors of odd sizes between small ones and objects: each big one's data is padded
    # to its address modulo a block of the file; small ones follow their neighbour directly.
    state = {
        "a": torch.randn(300_001),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(513, 1025, dtype=torch.float64),
        "note": {"step": 3},
        "d": torch.randn(262_144),
    }
    # The pool's path alone: writes from the live tensors go through the file's buffer
    # (flush._write_live; tests/test_live_flush.py).
    writer = DataStatesWriter(
        tmp_path / "ckpt", flush_workers=1, chunk_bytes=2 << 20, live_flush=False
    )
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
    finally:
        writer.close()

    entries = decode_manifest((tmp_path / "ckpt" / MANIFEST_NAME).read_bytes())
    big = {k: e for k, e in entries.items() if e.data_length >= localfile.EXTERNAL_MIN}
    assert sorted(big) == ["a@0", "c@0,0", "d@0"]
    # Each at its tensor's address modulo a block: its pool copy lies the same way (pieces.py),
    # so either can be written directly.
    for key, e in big.items():
        assert e.data_offset % ALIGN == state[key.split("@")[0]].data_ptr() % ALIGN, key
    assert sum(taken) >= sum(e.data_length for e in big.values()) - len(taken) * ALIGN
    ends = sorted((e.offset, e.offset + e.length) for e in entries.values())
    assert all(b[0] - a[1] < ALIGN for a, b in zip(ends, ends[1:], strict=False))
    blob = (tmp_path / "ckpt" / "__0_0.distcp").read_bytes()
    c = big["c@0,0"]
    assert blob[c.data_offset : c.data_offset + c.data_length] == state["c"].numpy().tobytes()

    loaded = {k: torch.zeros_like(v) if torch.is_tensor(v) else v for k, v in state.items()}
    loaded["note"] = {"step": 0}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)  # stock reader
    for key, value in state.items():
        if torch.is_tensor(value):
            assert torch.equal(loaded[key], value), key
    assert loaded["note"] == {"step": 3}


@pytest.mark.parametrize("refuse_direct", [False, True])
def test_bytes_copied_in_are_the_ones_written_whatever_their_source_does_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse_direct: bool
) -> None:
    """The flush's live writes: a source read into the buffer a step at a time (``copy_in``),
    its whole blocks queued and written (``queue_buffered``, ``submit``), and the source
    overwritten right after each ``copy_in``, as a tensor may be once the step is read. The file
    holds the bytes as they were when copied in, unaligned heads and steps included; so does a
    file whose direct writes the file system refuses (its ``copy_in`` writes a private copy)."""
    _direct_or_skip(tmp_path / "probe")
    if refuse_direct:
        real_writev = os.writev

        def refuse(fd: int, segments: Any) -> int:
            if _flags(fd) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_writev(fd, segments)

        monkeypatch.setattr(localfile.os, "writev", refuse)
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, 3 * ALIGN * 100 + 123, dtype=np.uint8)
    expected = bytearray(b"head" * 3)  # an unaligned start, as a record's head is
    with LocalStorage(tmp_path).open_write("data.bin", sync=True) as f:
        f.write(bytes(expected))
        step = ALIGN * 50 + 7
        for at in range(0, source.nbytes, step):
            part = memoryview(source[at : at + step])
            assert f.room() >= part.nbytes
            copied = f.copy_in(part)
            expected += bytes(part)
            source[at : at + step] = 0  # the source changes: the file must not see it
            assert bytes(copied) == bytes(expected[-part.nbytes :])
            f.queue_buffered()
            f.submit()
    assert (tmp_path / "data.bin").read_bytes() == bytes(expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX")
def test_direct_write_buffers_are_private_to_the_process() -> None:
    """``mmap``'s anonymous default is shared: a process forked from this one wrote into the
    pages this one's files were being written from."""
    buf = localfile._anonymous()
    buf[:6] = b"parent"
    pid = os.fork()
    if pid == 0:  # only a write and an exit in the child
        buf[:6] = b"child!"
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert buf[:6] == b"parent"
    buf.close()
