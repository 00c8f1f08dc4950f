"""The shared remote tier on a Valkey (or Redis) server, through the ``valkey`` client."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import torch

from kvblocks._extras import raise_missing_extra
from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.tiers.codec import (
    Payload,
    check_block_hash,
    check_payload,
    decode_block,
    encode_block,
)
from kvblocks.tiers.errors import CorruptBlockError, UnauthenticatedBlockError
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.mac import RecordKey, resolve_key
from kvblocks.tiers.stats import TierStats
from kvblocks.validation import (
    check_int,
    check_iterable,
    check_number,
    check_optional_int,
    check_priority,
)

try:
    import valkey
    from valkey.backoff import NoBackoff
    from valkey.exceptions import ConnectionError as _ValkeyConnectionError
    from valkey.exceptions import TimeoutError as _ValkeyTimeoutError
    from valkey.exceptions import ValkeyError
    from valkey.retry import Retry
except ModuleNotFoundError as _exc:
    raise_missing_extra(_exc, "kvblocks.tiers.valkey_tier", "tiers", ["valkey"])

__all__ = ["ValkeyTier"]

_TTL_MAX_S = 2**53
"""Longest ``ttl_s``: the server refuses an expiry whose milliseconds from now overflow
an int64 (2**62 s dropped every put), and 2**53 s keeps a margin of millennia."""

# The client methods the tier calls: a ``client`` without them failed at the first call.
_CLIENT_METHODS = ("pipeline", "scan_iter", "delete", "close")

logger = logging.getLogger("kvblocks.tiers")

# Errors that mean "the server is not reachable now" (as opposed to a command it refused).
_UNREACHABLE = (_ValkeyConnectionError, _ValkeyTimeoutError, OSError)
# Every failure a command can end in; none of them reaches the caller.
_FAILURES = (ValkeyError, OSError)


class ValkeyTier:
    """Block records (header + payload, :mod:`kvblocks.tiers.codec`) as values on a Valkey
    or Redis server, shared by every instance that uses the same server and layout.

    The key of a block is ``key_prefix + fingerprint hex + ":" + block hash hex``, so
    instances of the same weights and layout share blocks and others never meet them (the
    layout must name its weights: :meth:`~kvblocks.tiers.layout.KVLayout.require_identity`). Reads
    are pipelined MGETs of ``batch_size`` keys; a value that is short, corrupted, or made
    for another layout or block is rejected (``stats().rejected``; the first one warned
    about, once per tier, the rest logged at debug level) and read as a miss.

    Capacity and eviction are the server's: run it with ``maxmemory`` and an LRU
    ``maxmemory-policy`` (``allkeys-lru``); ``ttl_s`` optionally expires blocks (at most
    2**53 s). The server cannot keep per-block priorities, so ``priority`` is accepted and
    ignored.

    Faults: every command runs under ``socket_timeout_s``; when the server is unreachable the
    tier logs one warning (on the ``kvblocks.tiers`` logger), reads return misses and puts
    are dropped (``dropped_puts``) without touching the network for ``retry_interval_s``,
    after which it reconnects by itself. A server that answers but refuses commands (a
    database number it does not have, out of memory under ``noeviction``) is one warning
    too, per kind (reads, writes) until one of that kind succeeds again; its reads miss
    and its puts are dropped. A
    ``client`` passed in keeps its own timeouts and retries (set a socket timeout on it).
    Like the other tiers, one instance is for one thread.

    Trust: without a key, anyone who can write to the server can change what every instance
    reads (a record with a valid CRC is accepted). ``mac_key`` (else the secret in
    ``$KVBLOCKS_TIER_KEY``; see :mod:`kvblocks.tiers.mac`) signs every record written and
    rejects every record read without a valid MAC (``stats().unauthenticated``).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 6379,
        client: Any = None,
        key_prefix: str = "kvblocks:",
        socket_timeout_s: float = 1.0,
        retry_interval_s: float = 2.0,
        ttl_s: int | None = None,
        batch_size: int = 64,
        mac_key: RecordKey | bytes | str | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        layout.require_identity("a ValkeyTier")
        # A NaN or infinite time passes a comparison here and fails only the socket later.
        # Past threading.TIMEOUT_MAX the socket's deadline overflows the clock at the
        # first command (OverflowError).
        socket_timeout_s = check_number(
            socket_timeout_s, "socket_timeout_s", positive=True, maximum=threading.TIMEOUT_MAX
        )
        retry_interval_s = check_number(retry_interval_s, "retry_interval_s", minimum=0)
        ttl_s = check_optional_int(ttl_s, "ttl_s", minimum=1, maximum=_TTL_MAX_S)
        batch_size = check_int(batch_size, "batch_size", minimum=1, expected="a positive int")
        if not isinstance(key_prefix, str):
            raise InvalidArgumentError(f"key_prefix must be a str, got {key_prefix!r}")
        if url is not None and not isinstance(url, str):
            raise InvalidArgumentError(f"url must be a str or None, got {url!r}")
        if client is None and url is None:
            # The client connects lazily: a bad host or port would only read as an outage.
            if not isinstance(host, str) or not host:
                raise InvalidArgumentError(f"host must be a non-empty str, got {host!r}")
            port = check_int(port, "port", minimum=1, maximum=65535)
            _check_host(host, "host")
        if client is not None and not all(
            callable(getattr(client, name, None)) for name in _CLIENT_METHODS
        ):
            raise InvalidArgumentError(
                f"client must be a valkey.Valkey (or a client with {', '.join(_CLIENT_METHODS)}"
                f"), got {type(client).__name__}"
            )
        self.layout = layout
        self._key = resolve_key(mac_key)
        self._prefix = f"{key_prefix}{layout.fingerprint.hex()}:".encode()
        self._ttl = ttl_s
        self._batch = batch_size
        self._retry_interval = float(retry_interval_s)
        if client is None:
            options: dict[str, Any] = {
                "socket_timeout": socket_timeout_s,
                "socket_connect_timeout": socket_timeout_s,
                # One try per command: the tier's own back-off decides when to try again.
                "retry": Retry(NoBackoff(), 0),
                "retry_on_timeout": False,
                "health_check_interval": 0,
            }
            if url is not None:
                try:
                    client = valkey.Valkey.from_url(url, **options)
                except ValueError as exc:  # a scheme, port, db or option it cannot read
                    raise InvalidArgumentError(f"url {url!r} is no Valkey URL: {exc}") from None
                _check_host(client.connection_pool.connection_kwargs.get("host"), f"url {url!r}")
                _check_db_path(url)
            else:
                client = valkey.Valkey(host=host, port=port, **options)
        self._client = client
        self._stats = TierStats()
        self._down_until = 0.0
        self._outage = False
        self._refusing: set[str] = set()  # "read", "write": kinds being refused
        self._warned_rejected = False

    @property
    def capacity_blocks(self) -> None:
        """None: the server's ``maxmemory`` bounds the tier."""
        return None

    @property
    def client(self) -> Any:
        """The ``valkey.Valkey`` client (for administration and tests)."""
        return self._client

    def is_available(self) -> bool:
        """False while the tier is backing off after the server was unreachable."""
        return time.monotonic() >= self._down_until

    def key_of(self, block_hash: bytes) -> bytes:
        """The server key of ``block_hash``'s record."""
        return self._prefix + check_block_hash(block_hash).hex().encode()

    def __len__(self) -> int:
        """Blocks of this layout on the server (a SCAN: O(keys); 0 when unreachable)."""
        if not self.is_available():
            return 0
        try:
            count = sum(1 for _ in self._client.scan_iter(match=self._prefix + b"*", count=1000))
        except _FAILURES as exc:
            self._failed(exc, "read")
            return 0
        self._succeeded("read")
        return count

    def _failed(self, exc: Exception, kind: str) -> None:
        self._stats.errors += 1
        if not isinstance(exc, _UNREACHABLE):
            self._refused(exc, kind)
            return
        self._down_until = time.monotonic() + self._retry_interval
        if not self._outage:
            self._outage = True
            logger.warning(
                f"Valkey tier unreachable ({exc}); reads miss and puts are dropped, "
                f"retrying every {self._retry_interval:g} s"
            )

    def _refused(self, exc: Exception, kind: str) -> None:
        """The server answered but refused a ``kind`` ("read" or "write") command (a
        database it does not have, out of memory under ``noeviction``, an ACL): one warning
        until a command of that kind succeeds again, as for an outage. Per kind: out of
        memory refuses writes while reads succeed, and one must not end the other's report.
        The server answered: an outage it was in is over."""
        self._reachable()
        if kind not in self._refusing:
            self._refusing.add(kind)
            logger.warning(
                f"Valkey tier: the server refused a {kind} ({exc}); "
                + ("reads miss" if kind == "read" else "puts are dropped")
                + " while it does (stats().errors counts them)"
            )

    def _reachable(self) -> None:
        if self._outage:
            self._outage = False
            logger.info("Valkey tier reachable again")

    def _succeeded(self, kind: str) -> None:
        self._reachable()
        if kind in self._refusing:
            self._refusing.discard(kind)
            logger.info(f"Valkey tier: the server accepts {kind}s again")

    def put(self, block_hash: bytes, kv: Payload, *, priority: int = 0) -> bool:
        """Store one block; False (and counted as dropped) when the server is unreachable."""
        return self.put_many([block_hash], [kv], priority=priority) == 1

    def put_many(
        self, block_hashes: Sequence[bytes], kvs: Sequence[Payload], *, priority: int = 0
    ) -> int:
        """Store several blocks in one pipeline; how many were stored."""
        block_hashes = list(check_iterable(block_hashes, "block_hashes", "bytes"))
        kvs = list(check_iterable(kvs, "kvs", "payloads"))
        if len(block_hashes) != len(kvs):
            raise InvalidArgumentError(f"{len(block_hashes)} block hashes but {len(kvs)} payloads")
        check_priority(priority)
        if not block_hashes:
            return 0
        if not self.is_available():
            # Validate as a live put would, but spend no encoding on blocks about to be dropped.
            for h, kv in zip(block_hashes, kvs, strict=True):
                check_block_hash(h)
                check_payload(self.layout, kv)
            self._stats.dropped_puts += len(block_hashes)
            return 0
        records = [
            (self.key_of(h), encode_block(self.layout, h, kv, self._key))
            for h, kv in zip(block_hashes, kvs, strict=True)
        ]
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, record in records:
                pipe.set(key, record, ex=self._ttl)
            results = pipe.execute(raise_on_error=False)
        except _FAILURES as exc:
            self._failed(exc, "write")
            self._stats.dropped_puts += len(records)
            return 0
        stored = 0
        refused = None
        for result in results:
            if isinstance(result, Exception):
                # e.g. OOM with maxmemory-policy noeviction: the server refused this one.
                self._stats.errors += 1
                self._stats.dropped_puts += 1
                refused = refused or result
            else:
                stored += 1
        if refused is None:
            self._succeeded("write")
        else:
            self._refused(refused, "write")
        self._stats.puts += stored
        self._stats.bytes_in += stored * self.layout.payload_nbytes
        return stored

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each block's verified payload (pipelined MGETs), None for misses and rejects."""
        hashes = [
            check_block_hash(h) for h in check_iterable(block_hashes, "block_hashes", "bytes")
        ]
        if not hashes:
            return []
        if not self.is_available():
            self._stats.misses += len(hashes)
            return [None] * len(hashes)
        keys = [self._prefix + h.hex().encode() for h in hashes]
        try:
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(keys), self._batch):
                pipe.mget(keys[start : start + self._batch])
            chunks = pipe.execute()
        except _FAILURES as exc:
            self._failed(exc, "read")
            self._stats.misses += len(hashes)
            return [None] * len(hashes)
        self._succeeded("read")
        values = [value for chunk in chunks for value in chunk]
        return [self._decode(h, value) for h, value in zip(hashes, values, strict=True)]

    def _decode(self, block_hash: bytes, value: bytes | None) -> torch.Tensor | None:
        if value is None:
            self._stats.misses += 1
            return None
        try:
            payload = decode_block(self.layout, block_hash, value, self._key)
        except CorruptBlockError as exc:
            # One warning per tier (as the disk tier): a damaged store, or writers without
            # this reader's key, reject every read, and each is counted in the stats.
            level = logging.DEBUG if self._warned_rejected else logging.WARNING
            self._warned_rejected = True
            logger.log(
                level,
                "Valkey tier rejected block %s: %s; such blocks read as misses "
                "(stats().rejected counts them)",
                block_hash.hex(),
                exc,
            )
            self._stats.rejected += 1
            if isinstance(exc, UnauthenticatedBlockError):
                self._stats.unauthenticated += 1
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._stats.bytes_out += payload.nbytes
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block's key exists (one pipeline; all False when unreachable)."""
        keys = [self.key_of(h) for h in check_iterable(block_hashes, "block_hashes", "bytes")]
        if not keys or not self.is_available():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            results = pipe.execute()
        except _FAILURES as exc:
            self._failed(exc, "read")
            return [False] * len(keys)
        self._succeeded("read")
        return [bool(r) for r in results]

    def evict(self, block_hash: bytes) -> bool:
        """Delete one block's key; False when absent or unreachable."""
        key = self.key_of(block_hash)
        if not self.is_available():
            return False
        try:
            removed = self._client.delete(key)
        except _FAILURES as exc:
            self._failed(exc, "write")
            return False
        self._succeeded("write")
        if removed:
            self._stats.evictions += 1
        return bool(removed)

    def stats(self) -> TierStats:
        """A snapshot of this client's counters."""
        return self._stats.copy()

    def close(self) -> bool:
        """Close the client's connections (the blocks stay on the server); True (a
        connection that fails to close is gone either way)."""
        with contextlib.suppress(*_FAILURES):
            self._client.close()
        return True


def _check_host(host: object, name: str) -> None:
    """Raise InvalidArgumentError unless ``host`` (a str, a URL's host or None for a Unix
    socket) is a name the socket layer can encode: one with an empty label (``a..b``) or
    a label over 63 characters raised UnicodeError out of the first command."""
    if host is None:
        return
    try:
        str(host).encode("idna")
    except UnicodeError as exc:
        raise InvalidArgumentError(f"{name}: host {host!r} is no valid host name ({exc})") from None


def _check_db_path(url: str) -> None:
    """Raise InvalidArgumentError unless a TCP url's path is empty or a database number:
    the client ignores any other path (``/abc``, ``/-1``) and the tier used database 0."""
    parsed = urllib.parse.urlparse(url)
    db = parsed.path.strip("/")
    if parsed.scheme != "unix" and db and not (db.isascii() and db.isdigit()):
        raise InvalidArgumentError(
            f"url {url!r}: the path must be a database number such as /0, got {parsed.path!r}"
        )
