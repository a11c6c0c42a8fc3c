"""Requests to an S3-compatible store: one retry loop with back-off, errors sorted into
transient (retried) and permanent (raised at once, naming bucket, key and cause).

Requests run as coroutines on s3fs's event loop with its aiobotocore client, not through s3fs's
own wrapper (which retries some transient errors and not others); :class:`_Client` makes them
callable, retried, from any thread. Used by :mod:`dcp_datastates.storage.s3`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import DataStatesError

logger = logging.getLogger(__name__)

#: Error codes that mean "try again later", whatever the HTTP status says.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
    }
)

#: What to do again later after a request of this kind gave up: only reads and writes of data
#: are one side's (a listing or a HEAD serves saves and loads alike).
_AGAIN = {"get_object": "load", "put_object": "save", "upload_part": "save"}
_HINTS = {
    errno.EACCES: "check the credentials and that they may read and write this prefix",
    errno.ENOENT: "check the bucket name and the endpoint, or create the bucket",
}


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently an object-store request is retried.

    Attributes:
        attempts: Tries per request, the first included (1 turns retries off).
        base_s: Back-off before the second try; it doubles per try, with full jitter.
        max_s: Cap on one back-off.
    """

    attempts: int = 6
    base_s: float = 0.1
    max_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts={self.attempts!r} must be an int of at least 1")
        if self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError(f"need 0 <= base_s <= max_s, got {self.base_s!r}, {self.max_s!r}")

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_s, self.base_s * 2**attempt))


class ObjectStoreError(DataStatesError, OSError):
    """An object-store request failed for good (permanently, or after every retry).

    Attributes: ``bucket``, ``key``, ``operation``, ``code`` (the S3 error code or exception
    name) and ``transient`` (it was retryable, and retries ran out).
    """

    def __init__(
        self, err: int, message: str, *, bucket: str, key: str, operation: str, code: str
    ) -> None:
        super().__init__(err, message)
        self.filename = f"s3://{bucket}/{key}"
        self.bucket, self.key, self.operation, self.code = bucket, key, operation, code
        self.transient = False


def classify(exc: BaseException) -> tuple[bool, int, str, str]:
    """``(transient, errno, code, detail)`` of a failed request."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.parsers import ResponseParserError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        detail = f"{code} (HTTP {status}): {err.get('Message', '')}".rstrip(": ")
        transient = status >= 500 or status in (408, 429) or code in _TRANSIENT_CODES
        number = {403: errno.EACCES, 404: errno.ENOENT}.get(status, errno.EIO)
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            number = errno.EACCES
        return transient, number, code, detail
    name = type(exc).__name__
    transient = isinstance(
        exc,
        (
            HTTPClientError,  # resets, closed connections, read timeouts
            BotoConnectionError,  # endpoint unreachable
            ResponseParserError,  # throttling answers are sometimes not valid XML
            ConnectionError,
            TimeoutError,
            asyncio.TimeoutError,
        ),
    )
    with contextlib.suppress(ImportError):
        import aiohttp

        transient = transient or isinstance(exc, aiohttp.ClientError)
    return transient, errno.EIO, name, f"{name}: {exc}"


class _Client:
    """Retried requests on s3fs's event loop, callable from any thread."""

    def __init__(self, fs: Any, bucket: str, retry: RetryPolicy) -> None:
        self.fs, self.bucket, self.retry = fs, bucket, retry

    async def call(self, op: str, key: str, sink: Any = None, **kw: Any) -> Any:
        """``op`` on ``key``; the body of a GET goes to ``sink(body)`` inside the retried try."""
        for attempt in range(self.retry.attempts):
            try:
                await self.fs.set_session()
                s3 = await self.fs.get_s3(self.bucket)
                args = {"Bucket": self.bucket, **({"Key": key} if key is not None else {}), **kw}
                out = await getattr(s3, op)(**args)
                return await sink(out["Body"]) if sink is not None else out
            except Exception as exc:
                transient, number, code, detail = classify(exc)
                if not transient or attempt + 1 == self.retry.attempts:
                    raise self.error(op, key, number, code, detail, transient, attempt + 1) from exc
                pause = self.retry.delay(attempt)
                logger.info(
                    "s3://%s/%s: %s failed (%s); retry in %.2fs",
                    self.bucket,
                    key,
                    op,
                    detail,
                    pause,
                )
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    def error(
        self,
        op: str,
        key: str | None,
        number: int,
        code: str,
        detail: str,
        transient: bool,
        tries: int,
    ) -> ObjectStoreError:
        where = f"s3://{self.bucket}/{key or ''}"
        if transient:
            again = _AGAIN.get(op, "try")
            hint = (
                f"gave up after {tries} tries; the store is down or throttling, {again} again later"
            )
        else:
            hint = _HINTS.get(number, "not retried (a permanent failure)")
        exc = ObjectStoreError(
            number,
            f"{where}: {op} failed: {detail}; {hint}",
            bucket=self.bucket,
            key=key or "",
            operation=op,
            code=code,
        )
        exc.transient = transient
        return exc

    def submit(self, op: str, key: str, sink: Any = None, **kw: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(self.call(op, key, sink, **kw), self.fs.loop)

    def __call__(self, op: str, key: str, sink: Any = None, **kw: Any) -> Any:
        return self.submit(op, key, sink, **kw).result()


__all__ = ["ObjectStoreError", "RetryPolicy", "classify"]
