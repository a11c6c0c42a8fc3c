"""The retention helper both checkpointers use, on its own: real step directories in
``tmp_path`` (and ``memory://``), no checkpointer, no save."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_datastates.checkpointers.retention import (
    InUse,
    delete_checkpoint,
    delete_expired,
    expired,
)
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.storage.base import LocalStorage, storage_for


def _committed(root: Path, *steps: int) -> list[int]:
    for step in steps:
        (root / f"s{step}").mkdir()
        (root / f"s{step}" / "__0_0.distcp").write_bytes(b"data")
        (root / f"s{step}" / METADATA_NAME).write_bytes(b"meta")
    return list(steps)


def _deleter(root: Path, order: list[int]):
    def delete(step: int) -> None:
        order.append(step)
        delete_checkpoint(LocalStorage(root / f"s{step}"), missing_ok=False)

    return delete


def test_expired_is_all_but_the_newest_keep_oldest_first() -> None:
    assert expired([5, 1, 3, 4], 2) == [1, 3]
    assert expired([1, 2], 2) == []
    assert expired([7], 1) == []  # never the newest
    assert expired([], 3) == []


def test_old_steps_are_deleted_oldest_first_and_the_newest_kept(tmp_path: Path) -> None:
    steps = _committed(tmp_path, 1, 2, 3, 4)
    order: list[int] = []
    done = delete_expired(steps, 2, _deleter(tmp_path, order))
    assert done.deleted == [1, 2] and done.failed == [] and order == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s3", "s4"]


def test_one_step_that_cannot_be_deleted_does_not_keep_the_others(tmp_path: Path) -> None:
    """Step 1's ``.metadata`` is a directory, which ``unlink`` refuses: it stays committed,
    step 2 still goes, and the failure names step 1's path."""
    steps = _committed(tmp_path, 1, 2, 3)
    stuck = tmp_path / "s1" / METADATA_NAME
    stuck.unlink()
    stuck.mkdir()
    seen: list[int] = []
    done = delete_expired(
        steps,
        1,
        _deleter(tmp_path, []),
        errors=OSError,
        on_error=lambda step, exc: seen.append(step),
    )
    assert done.deleted == [2] and seen == [1]
    ((step, exc),) = done.failed
    assert step == 1 and isinstance(exc, OSError) and "s1" in str(exc)
    assert stuck.is_dir() and (tmp_path / "s1" / "__0_0.distcp").exists()
    assert not (tmp_path / "s2").exists()


def test_an_error_retention_does_not_go_past_propagates(tmp_path: Path) -> None:
    steps = _committed(tmp_path, 1, 2, 3)

    def delete(step: int) -> None:
        raise KeyError(step)

    with pytest.raises(KeyError):
        delete_expired(steps, 1, delete, errors=OSError)


def test_steps_needed_or_in_use_are_passed_over(tmp_path: Path) -> None:
    steps = _committed(tmp_path, 1, 2, 3, 4)
    in_use = InUse()
    in_use.add(2, 1)  # a reader holds step 2
    done = delete_expired(
        steps, 1, _deleter(tmp_path, []), needed=lambda step: step == 1, claim=in_use.claim
    )
    assert done.deleted == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1", "s2", "s4"]
    in_use.add(2, -1)  # the reader is done: the next pass deletes it
    assert delete_expired(steps[1:], 1, _deleter(tmp_path, []), claim=in_use.claim).deleted == [2]


def test_a_step_being_deleted_is_held_until_its_delete_ends() -> None:
    in_use = InUse()
    with in_use.claim("a") as free:
        assert free
        with in_use.claim("a") as again:
            assert not again
    with in_use.claim("a") as free:
        assert free  # released


def test_delete_checkpoint_uncommits_and_removes_every_file(
    tmp_path: Path, memory_url: str
) -> None:
    for where in (str(tmp_path / "ckpt"), memory_url):
        storage = storage_for(where)
        storage.makedirs()
        storage.put_atomic("__0_0.distcp", b"data", sync=True)
        storage.put_atomic(METADATA_NAME, b"meta", sync=True)
        delete_checkpoint(storage)
        assert storage.list_names() == [], where


def test_a_missing_metadata_is_an_error_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    delete_checkpoint(LocalStorage(tmp_path / "ckpt"))  # gone already: nothing to uncommit
    assert not (tmp_path / "ckpt").exists()
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="ckpt"):
        delete_checkpoint(LocalStorage(tmp_path / "ckpt"), missing_ok=False)
    assert (tmp_path / "ckpt").exists()  # nothing removed after a failed uncommit
