"""The pieces of a snapshot: their states, and how a save's items are laid out into them.

Owns: the piece states (``PENDING`` … ``WRITTEN``; their transitions are written out once, in
``session.py``), :class:`Piece`, :class:`Slice`, :class:`LiveWrite`, and :func:`lay_out`, which
cuts items into pieces without touching a pool, a lock or a thread.
Not here: the transitions themselves (``session.py``) and admitting pieces into the pool and
copying them (``scheduler.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._concurrency.latch import Latch
from ..providers import StateProvider
from .device import Completion

#: A piece's states, the names used in code and logs (the diagram: ``session.py``).
PENDING, ADMITTED, COPIED, RELEASED, SKIPPED, FAILED, LIVE, WRITTEN = (
    "PENDING",
    "ADMITTED",
    "COPIED",
    "RELEASED",
    "SKIPPED",
    "FAILED",
    "LIVE",
    "WRITTEN",
)


@dataclass(eq=False)
class Piece:
    seq: int
    nbytes: int
    #: (provider, source start, source stop, offset inside the piece)
    parts: list[tuple[StateProvider, int, int, int]] = field(default_factory=list)
    state: str = PENDING
    offset: int = -1  # pool offset once ADMITTED
    refs: int = 0
    copying: bool = False  # a copy worker took it: the flush may no longer write it live
    done: Latch = field(default_factory=Latch)
    #: set once the piece has its pool block (or is done): a live write may claim it then
    admitted: Latch = field(default_factory=Latch)
    #: set once the copy is enqueued on the device (or the piece is done): a fence may follow
    enqueued: Latch = field(default_factory=Latch)
    completion: Completion | None = None
    #: an optimizer step's stream waits on this piece's copy (``fence_on_device``), and its
    #: versions were checked then: a bump since came from work queued behind the copy
    fenced: bool = False

    def finish(self) -> None:
        self.admitted.set()
        self.enqueued.set()
        self.done.set()

    def check_unchanged(self, rank: int) -> None:
        for provider, _, _, _ in self.parts:
            provider.check_unchanged(rank)

    def first_fence(self, rank: int, lock: threading.Lock) -> BaseException | None:
        """An optimizer step's stream now waits on this piece's copy (``fence_on_device``):
        at the first fence, the error if a source changed since ``stage()`` (queued before the
        step, not behind the copy). At a later one (a second optimizer, the next step while
        copies run) None: on a GPU versions move when kernels are enqueued, and every bump
        since the first fence is a fenced step's or later work on a fenced stream, queued behind
        the copy (DESIGN §13; a write on another stream is the copy-on-write's to catch)."""
        with lock:
            first, self.fenced = not self.fenced, True
        if first:
            try:
                self.check_unchanged(rank)
            except BaseException as exc:
                return exc
        return None


class LiveWrite:
    """A LIVE piece's write from the live tensor (``flush._write_live``): ``n`` live bytes at
    address ``src``, of which the flush has read ``read`` (into its file's buffer, a step at a
    time, under ``lock``); the rest, if the write is taken over, goes to the pool at ``dst``
    (set by ``claim_live``). It ends once, under ``lock``, in
    :meth:`SnapshotSession.end_live_write`."""

    def __init__(
        self, piece: Piece, provider: Any, view: memoryview, src: int, span: tuple[int, int, int]
    ) -> None:
        self.piece, self.provider, self.view, self.src = piece, provider, view, src
        # The part's bytes in the tensor ([start, stop)) and where they start inside the piece.
        self.start, self.stop, self.at = span
        self.n = view.nbytes
        self.dst = 0
        self.lock = threading.Lock()
        self.read = 0
        self.ended = False
        self.error: BaseException | None = None


@dataclass(frozen=True)
class Slice:
    """Part of one item's data: ``length`` bytes at ``start`` inside ``piece``."""

    piece: Piece
    start: int
    length: int


@dataclass(frozen=True)
class Layout:
    """What :func:`lay_out` made of a save's items.

    Attributes:
        providers: each item's provider, by key, in snapshot order.
        slices: each item's slices, by key (none for an empty item).
        pieces: the pieces, all PENDING, in sequence order (``seq`` is the index).
        live_parts: parts the flush may write from the live tensor (big contiguous host
            tensors, laid at their address modulo a block).
    """

    providers: dict[Any, StateProvider]
    slices: dict[Any, list[Slice]]
    pieces: list[Piece]
    live_parts: int


def lay_out(items: Sequence[tuple[Any, StateProvider]], chunk: int, small: int) -> Layout:
    """Cut ``items`` ((key, provider) pairs, in snapshot order) into pieces: a tensor of at
    least ``small`` bytes into pieces of at most ``chunk`` bytes (``provider.split``), and
    consecutive smaller ones coalesced into pieces of at most ``chunk``; a big tensor ends a
    coalesced piece. Tells each provider of its parts (``note_part``), nothing else."""
    providers: dict[Any, StateProvider] = {}
    slices: dict[Any, list[Slice]] = {}
    pieces: list[Piece] = []
    live_parts = 0

    def new_piece() -> Piece:
        piece = Piece(seq=len(pieces), nbytes=0)
        pieces.append(piece)
        return piece

    def add(key: Any, piece: Piece, provider: StateProvider, start: int, stop: int) -> None:
        nonlocal live_parts
        at = piece.nbytes
        at += (-at) % 64  # keep every part aligned for dtype views of the pool
        # Only a piece's first part: the lookup is skipped for the rest (thousands of small
        # tensors coalesced).
        if (
            at == 0
            and (skew := getattr(provider, "live_skew", None)) is not None
            and (s := skew(start)) is not None
        ):
            # A part the flush may write from the live tensor lies in the pool at the same
            # address modulo a block: its record's padding then suits both (flush.py).
            at = s
            live_parts += 1
        piece.parts.append((provider, start, stop, at))
        note_part = getattr(provider, "note_part", None)
        if note_part is not None:
            note_part()
        piece.nbytes = at + (stop - start)
        piece.refs += 1
        slices.setdefault(key, []).append(Slice(piece, at, stop - start))

    batch: Piece | None = None
    for key, provider in items:
        providers[key] = provider
        nbytes = provider.nbytes
        if nbytes == 0:
            slices[key] = []
            continue
        if nbytes < small:
            if batch is None or batch.nbytes + nbytes > chunk:
                batch = new_piece()
            add(key, batch, provider, 0, nbytes)
            continue
        batch = None
        for start, stop in provider.split(chunk):
            add(key, new_piece(), provider, start, stop)
    return Layout(providers=providers, slices=slices, pieces=pieces, live_parts=live_parts)
