"""``dcp-datastates``: look inside a checkpoint and check it without loading it.

    dcp-datastates inspect PATH [--json]   items, files per rank, format version, commit state
    dcp-datastates verify PATH             check every record's crc32c against the manifest
    dcp-datastates memory list|clean       this user's memory-tier segments (``cli_memory``)

A checkpoint saved with ``use_collectives=False`` has one commit record per rank
(``__{rank}.metadata``): both commands go through each (``--rank R`` picks one). Both name
an item by its manifest key, the fqn and the chunk's offsets (``w@0,0``), as load errors do.

Exit codes: 0 fine; 1 damaged (checksum mismatch, truncated or missing file) or refused by the
safe-load checks; 2 not committed (no ``.metadata``) or no checkpoint at the path; 3 (``verify``
only) nothing to verify: a stock DCP checkpoint has no manifest, so no checksums; 4 the storage
could not be read (an object store unreachable, no such bucket, access denied): nothing was
checked; 141 whoever read the output stopped reading (``| head``): the command stops quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, TextIO

from crc32c import crc32c
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from tqdm import tqdm

from . import cli_memory
from .errors import ChecksumMismatchError, DataStatesError
from .format import (
    DATA_SUFFIX,
    FORMAT_VERSION,
    METADATA_CRC_FIELD,
    METADATA_NAME,
    RANK_METADATA,
    RecordInfo,
    committed_with_manifest,
    decode_manifest,
    manifest_key,
    manifest_name,
    metadata_name,
)
from .load.reader import DataStatesReader
from .load.safety import check_relative_path, file_size, load_metadata
from .load.step_dirs import checkpoints_inside
from .storage.base import FsspecStorage, LocalStorage, storage_for

EXIT_OK, EXIT_DAMAGED, EXIT_NOT_COMMITTED, EXIT_NOTHING_TO_VERIFY, EXIT_UNREADABLE = 0, 1, 2, 3, 4
#: The reader of our output went away (``| head``). Not 0: what was left unprinted may be left
#: unchecked too (the other ranks' commit records). 128 + SIGPIPE, what the shell reports for
#: ``cat`` or ``git log`` cut short the same way, so ``set -o pipefail`` treats us alike.
EXIT_OUTPUT_CLOSED = 141
_CHUNK = 4 << 20
_DATA_FILE = re.compile(r"^__(\d+)_(k?\d+)" + re.escape(DATA_SUFFIX) + "$")
#: When several commit records are checked, the exit code of the worst one.
_WORST_FIRST = (EXIT_DAMAGED, EXIT_NOT_COMMITTED, EXIT_NOTHING_TO_VERIFY, EXIT_OK)


def _commit_ranks(storage: LocalStorage | FsspecStorage, rank: int | None) -> list[int | None]:
    """The commit records to look at: ``--rank``'s, else ``.metadata``, else every rank's."""
    if rank is not None:
        return [rank]
    if storage.exists(METADATA_NAME):
        return [None]
    found = (RANK_METADATA.match(n) for n in storage.list_names())
    return sorted(int(m.group(1)) for m in found if m) or [None]


def _each_commit(handler: Any, args: argparse.Namespace) -> int:
    storage = storage_for(args.path)
    if isinstance(storage, LocalStorage) and os.path.isfile(storage.root):
        print(f"error: {args.path} is a file; give a checkpoint's directory", file=sys.stderr)
        return EXIT_NOT_COMMITTED
    reports: list[dict[str, Any]] = []  # inspect --json: one document for all the records
    codes = [handler(args, storage, r, reports) for r in _commit_ranks(storage, args.rank)]
    if reports:
        many = {"path": args.path, "committed": True, "commit_records": reports}
        print(json.dumps(reports[0] if len(reports) == 1 else many, indent=1))
    return next(c for c in _WORST_FIRST if c in codes)


def _not_committed(
    path: str, storage: LocalStorage | FsspecStorage, as_json: bool, rank: int | None = None
) -> int:
    names = storage.list_names()
    files = [n for n in names if n.endswith(DATA_SUFFIX)]
    if as_json:
        print(
            json.dumps(
                {"path": path, "committed": False, "exists": bool(names), "data_files": files},
                indent=1,
            )
        )
    elif not names:
        print(f"{path}: NO CHECKPOINT (the directory is empty or does not exist)")
    elif not files and (inside := checkpoints_inside(storage, names, verb="run this on")):
        print(f"{path}: NO CHECKPOINT here, but it holds checkpoint directories: {inside}")
    else:
        print(f"{path}: NOT COMMITTED (no {metadata_name(rank)}; {len(files)} data file(s))")
        if rank is not None and METADATA_NAME in names:
            print(f"It has {METADATA_NAME}: it was saved with collectives; drop --rank.")
        else:
            print("The save that wrote it did not finish; do not load it.")
    return EXIT_NOT_COMMITTED


def _read_manifest(
    storage: LocalStorage | FsspecStorage, rank: int | None = None
) -> tuple[dict[str, Any] | None, dict]:
    name = manifest_name(rank)
    if not storage.exists(name):
        return None, {}
    with storage.open_read(name) as f:
        blob = f.read()
    manifest = decode_manifest(blob, storage.describe(name))  # checks it first
    return json.loads(blob), manifest


def _rank_of(name: str) -> str:
    match = _DATA_FILE.match(name)
    return match.group(1) if match else "?"


def _describe(path: str, metadata: Metadata, manifest: dict[str, RecordInfo], head: dict | None):
    items = []
    for index, sinfo in sorted(
        metadata.storage_data.items(), key=lambda kv: (kv[0].fqn, tuple(kv[0].offset or ()))
    ):
        md = metadata.state_dict_metadata.get(index.fqn)
        info = manifest.get(manifest_key(index.fqn, index.offset))
        item: dict[str, Any] = {"fqn": index.fqn}
        if md is None or isinstance(md, BytesStorageMetadata):
            item.update(kind=info.kind if info else "object", dtype=None, shape=None)
        else:
            sizes = next(
                (c.sizes for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())),
                md.size,
            )
            item.update(
                kind=info.kind if info else "tensor",
                dtype=str(md.properties.dtype).removeprefix("torch."),
                shape=list(sizes),
                chunk_offset=list(index.offset or ()),
                global_shape=list(md.size),
            )
        item.update(bytes=sinfo.length, file=sinfo.relative_path, file_offset=sinfo.offset)
        items.append(item)
    files: dict[str, list[str]] = defaultdict(list)
    for name in sorted({item["file"] for item in items}):
        files[_rank_of(name)].append(name)
    return {
        "path": path,
        "committed": True,
        "format": head["format"] if head else "stock DCP (no manifest)",
        "format_version": head["version"] if head else None,
        "dcp_metadata_version": getattr(metadata, "version", None),
        "torch": head.get("torch") if head else None,
        "world_size": head.get("world_size") if head else None,
        "verifiable": head is not None,
        "files": dict(files),
        "items": items,
    }


def _shown(key: str) -> str:
    """``key`` on one line: characters that do not print (a newline, a tab, NUL) escaped as
    Python writes them, so that one key never splits a listing's line (``--json`` escapes them
    itself)."""
    if key.isprintable():
        return key
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in key)


def _print_report(report: dict[str, Any], out: TextIO) -> None:
    version = report["format_version"]
    print(f"{report['path']}: committed", file=out)
    print(
        f"  format: {report['format']}"
        + (f" v{version} (this package reads v{FORMAT_VERSION})" if version is not None else "")
        + (f", written by torch {report['torch']}" if report["torch"] else ""),
        file=out,
    )
    if "commit_record" in report:  # a save with use_collectives=False: this rank's items only
        print(f"  commit record: {report['commit_record']} (this rank's items)", file=out)
    elif report["world_size"] is not None:
        print(f"  world size: {report['world_size']}", file=out)
    print(f"  files ({sum(len(v) for v in report['files'].values())}):", file=out)
    for rank, names in sorted(report["files"].items()):
        print(f"    rank {rank}: {' '.join(names)}", file=out)
    print(f"  items ({len(report['items'])}):", file=out)
    for item in report["items"]:
        what = f"{item['dtype']}{item['shape']}" if item["dtype"] is not None else "-"
        # Named by its manifest key (w@0,0), as verify and the load errors name it.
        name = manifest_key(item["fqn"], item.get("chunk_offset"))
        print(
            f"    {_shown(name)}  {item['kind']}  {what}  {item['bytes']} B  "
            f"{item['file']}+{item['file_offset']}",
            file=out,
        )


def _inspect(
    args: argparse.Namespace,
    storage: LocalStorage | FsspecStorage,
    rank: int | None,
    reports: list[dict[str, Any]],
) -> int:
    if not storage.exists(metadata_name(rank)):
        return _not_committed(args.path, storage, args.json, rank)
    try:
        reader = DataStatesReader(args.path, trusted=args.trusted)
        metadata = reader.read_metadata() if rank is None else reader.read_metadata(rank=rank)
        head, _ = _read_manifest(storage, rank)
    except (DataStatesError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DAMAGED
    report = _describe(args.path, metadata, reader.manifest or {}, head)
    if rank is not None:
        report["commit_record"] = metadata_name(rank)
    if args.json:
        reports.append(report)  # printed by _each_commit, with the other ranks' records
    else:
        _print_report(report, sys.stdout)
    return EXIT_OK


def _verify_record(f: Any, info: RecordInfo, progress: tqdm) -> tuple[int, int]:
    """(crc32c, bytes read) of ``[offset, offset + length)``, read in bounded chunks."""
    f.seek(info.offset)
    crc, got, left = 0, 0, info.length
    while left:
        block = f.read(min(left, _CHUNK))
        if not block:
            break
        crc = crc32c(block, value=crc)
        got += len(block)
        left -= len(block)
        progress.update(len(block))
    return crc, got


def _verify(
    args: argparse.Namespace,
    storage: LocalStorage | FsspecStorage,
    rank: int | None,
    reports: list[dict[str, Any]],
) -> int:
    meta = metadata_name(rank)
    if not storage.exists(meta):
        return _not_committed(args.path, storage, False, rank)
    try:
        # .metadata is read (safely) only to cross-check items; the records come from the
        # manifest, and truncation is reported per record rather than refused up front. Its
        # bytes are checked against the manifest's record of them before they are unpickled.
        head, manifest = _read_manifest(storage, rank)
        with storage.open_read(meta) as f:
            blob = f.read()
        expected = (head or {}).get(METADATA_CRC_FIELD)
        if isinstance(expected, int) and crc32c(blob) != expected:
            print(
                f"{args.path}{_of(rank)}: DAMAGED: {meta} has crc32c {crc32c(blob):#010x}, the "
                f"manifest expects {expected:#010x} (if another writer, such as stock "
                f"FileSystemWriter, saved over a checkpoint of ours, the manifest is its "
                f"leftover: remove {manifest_name(rank)})"
            )
            return EXIT_DAMAGED
        where = storage.describe(meta)
        metadata = pickle.loads(blob) if args.trusted else load_metadata(io.BytesIO(blob), where)
        for info in manifest.values():
            if not args.trusted:
                check_relative_path(storage, info.relative_path)
    except (DataStatesError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DAMAGED
    if head is None and committed_with_manifest(metadata):
        print(
            f"{args.path}{_of(rank)}: DAMAGED: no {manifest_name(rank)}, but {meta} was "
            "committed by dcp_datastates with it: the records' checksums are lost (restore it "
            "from where the checkpoint was copied)"
        )
        return EXIT_DAMAGED
    if head is None:
        print(
            f"{args.path}: no {manifest_name(rank)} (a stock DCP checkpoint): no checksums to "
            "verify"
        )
        return EXIT_NOTHING_TO_VERIFY

    failures: list[tuple[str, str, str]] = []  # (file, item, what)
    for index in metadata.storage_data:
        if manifest_key(index.fqn, index.offset) not in manifest:
            failures.append(("-", manifest_key(index.fqn, index.offset), "no manifest entry"))
    per_file: dict[str, list[tuple[str, RecordInfo]]] = defaultdict(list)
    for key, info in manifest.items():
        per_file[info.relative_path].append((key, info))
    progress = tqdm(
        total=sum(info.length for info in manifest.values()),
        desc="verify",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=args.quiet,
    )
    for name, records in sorted(per_file.items()):
        try:
            size = file_size(storage, name)
            f = storage.open_read(name)
        except FileNotFoundError:
            failures.extend((name, key, "file is missing") for key, _ in records)
            continue
        with f:
            for key, info in sorted(records, key=lambda r: r[1].offset):
                crc, got = _verify_record(f, info, progress)
                if got != info.length:
                    failures.append(
                        (name, key, f"truncated: {got} of {info.length} bytes (file has {size})")
                    )
                elif crc != info.crc32c:
                    failures.append(
                        (name, key, f"crc32c expected {info.crc32c:#010x}, actual {crc:#010x}")
                    )
    progress.close()
    if failures:
        print(f"{args.path}{_of(rank)}: DAMAGED: {len(failures)} of {len(manifest)} record(s) fail")
        for name, key, what in failures:
            print(f"  {name}  {_shown(key)}  {what}")
        return EXIT_DAMAGED
    print(f"{args.path}{_of(rank)}: OK: {len(manifest)} record(s) in {len(per_file)} file(s) match")
    return EXIT_OK


def _of(rank: int | None) -> str:
    return "" if rank is None else f" ({metadata_name(rank)})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcp-datastates",
        description="Inspect and verify DCP checkpoints written by dcp_datastates.",
        epilog=(
            "Exit codes: 0 ok, 1 damaged or refused, 2 not committed or no checkpoint at the "
            "path, 3 nothing to verify, 4 the storage could not be read, 141 the output's "
            "reader stopped reading."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("inspect", "list items, files per rank, format version and commit state"),
        ("verify", "check every record's crc32c against the manifest"),
    ):
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("path", help="checkpoint directory (local path or fsspec URL)")
        cmd.add_argument(
            "--trusted",
            action="store_true",
            help="unpickle .metadata with plain pickle (only for checkpoints you trust)",
        )
        cmd.add_argument(
            "--rank",
            type=int,
            default=None,
            help="only this rank's commit record __RANK.metadata (a save with "
            "use_collectives=False); by default .metadata, else every rank's",
        )
        if name == "inspect":
            cmd.add_argument("--json", action="store_true", help="print JSON instead of text")
        else:
            cmd.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    cli_memory.add_parser(sub)
    return parser


class _OutputClosed(Exception):
    """Writing to stdout or stderr found the pipe closed: not an ``OSError``, which is how the
    storage fails (a user sweep: ``inspect | head`` said it could not read the checkpoint)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.stream = stream


class _Output:
    """``stream``, whose closed pipe raises :class:`_OutputClosed`."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise _OutputClosed(self._stream) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise _OutputClosed(self._stream) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s file at /dev/null, so that what is still buffered, flushed at exit,
    raises nothing (Python's "Note on SIGPIPE"). Not SIG_DFL for SIGPIPE: that would also kill
    the process on a closed socket to an object store."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no file (captured)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit code (the module docstring lists them)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Output(out), _Output(err)  # type: ignore[assignment]
    try:
        try:
            return _main(argv)
        finally:  # also for argparse's SystemExit (--help): a closed pipe shows here, not at exit
            sys.stdout.flush()
            sys.stderr.flush()
    except _OutputClosed as closed:
        _to_devnull(closed.stream)
        for stream in (out, err):  # 2>&1 | head: the other one writes to the closed pipe too
            try:
                stream.flush()
            except BrokenPipeError:
                _to_devnull(stream)
        return EXIT_OUTPUT_CLOSED
    finally:
        sys.stdout, sys.stderr = out, err


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "memory":
        return cli_memory.run(args)
    handler = _inspect if args.command == "inspect" else _verify
    try:
        return _each_commit(handler, args)
    except ChecksumMismatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DAMAGED
    except OSError as exc:  # the storage itself (a user sweep: a traceback, exit code 1)
        print(f"error: cannot read {args.path}: {exc}; nothing was checked", file=sys.stderr)
        return EXIT_UNREADABLE


if __name__ == "__main__":
    sys.exit(main())
