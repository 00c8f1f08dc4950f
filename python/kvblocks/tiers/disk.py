"""The local-disk tier: one file per block under a directory named by the layout fingerprint."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.tiers.codec import (
    Payload,
    check_block_hash,
    decode_block,
    encode_block,
    payload_offset,
    record_nbytes,
)
from kvblocks.tiers.errors import CorruptBlockError, UnauthenticatedBlockError
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.lru import RetentionLRU
from kvblocks.tiers.mac import MAC_SIZE, RecordKey, resolve_key
from kvblocks.tiers.stats import TierStats
from kvblocks.tiers.store import put_each
from kvblocks.validation import check_bool, check_int, check_iterable, check_priority

__all__ = ["DiskTier"]

# Operational faults (an outage, a disk error) are logged, once, not raised or warned.
logger = logging.getLogger("kvblocks.tiers")

_SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
# File names are the block hash in hex; 100 bytes keeps a name far below NAME_MAX (255).
_MAX_HASH_BYTES = 100
# A write that fails with these means "no room": evict the LRU block and try again.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _open_regular(path: Path) -> BinaryIO | None:
    """``path`` opened for reading, or None (nothing left open) when it is not a regular
    file: a FIFO, socket or device put in a block's or ``layout.json``'s place.

    A plain open() of a FIFO waits for a writer, forever; with O_NONBLOCK it returns at
    once and fstat tells what was opened. Raises OSError as open() does.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)  # ordinary reads from here on
            return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


class DiskTier:
    """Block records (header + payload, :mod:`kvblocks.tiers.codec`) as files on local disk.

    Layout: ``directory/<fingerprint hex>/<block hash hex>.kvb``, plus a ``layout.json``
    describing the layout. The directory is the manifest: it is keyed by fingerprint and
    block hash, so reopening it (same directory, same layout) finds the same blocks, in the
    LRU order of their modification times (a hit refreshes the file's time). A different
    model or layout gets a different subdirectory and never sees these blocks; opening a
    directory that holds only other layouts' blocks logs a warning (on the
    ``kvblocks.tiers`` logger) so that changed weights, model id or dtype do not miss
    silently, and a subdirectory whose ``layout.json`` names another fingerprint (copied
    or renamed from another model) is rejected with a warning: its block files are
    removed (counted in ``rejected``), never loaded.

    A put writes a temporary file and renames it over the final name, so a crash mid-write
    leaves either the old state or the whole new record; leftover temporaries are removed
    on open, and every read verifies the record's checksum, so a torn or damaged file reads
    as a miss (counted in ``rejected``, one warning per tier) and is deleted; so does
    anything but a regular file in a block's place (a FIFO is never waited on). A full tier
    (``capacity_blocks``) or a full disk (ENOSPC) evicts LRU blocks and retries; a put fails
    only when even an empty tier cannot hold the block (counted in ``dropped_puts``, with
    one warning).

    Retention priorities order eviction within a process; after a reopen every block has
    the default priority. One process at a time may open a directory.

    ``mac_key`` (else the secret in ``$KVBLOCKS_TIER_KEY``; see :mod:`kvblocks.tiers.mac`)
    signs every record written and rejects every record read without a valid MAC
    (``stats().unauthenticated``, and removed): whoever can write to the directory without
    the key cannot plant blocks. Without a key, records are neither signed nor checked.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        layout: KVLayout,
        capacity_blocks: int,
        *,
        fsync: bool = False,
        mac_key: RecordKey | bytes | str | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        # Another process (or a restart with other weights) opens the same directory.
        layout.require_identity("a DiskTier")
        capacity_blocks = check_int(
            capacity_blocks, "capacity_blocks", minimum=1, expected="a positive int"
        )
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidTypeError(f"directory must be a path, got {type(directory).__name__}")
        if not os.fspath(directory):  # Path("") is the current directory: never meant
            raise InvalidArgumentError("directory must be a non-empty path, got ''")
        self.layout = layout
        self._key = resolve_key(mac_key)
        self._capacity = capacity_blocks
        self._fsync = check_bool(fsync, "fsync")
        self._root = Path(directory) / layout.fingerprint.hex()
        fresh = not self._root.exists()
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission: the argument is unusable
            raise InvalidArgumentError(
                f"directory {str(directory)!r} cannot hold the disk tier: {exc}"
            ) from exc
        self._index: RetentionLRU[int] = RetentionLRU()
        self._stats = TierStats()
        self._tmp_counter = itertools.count()
        self._warned = False
        self._warned_rejected = False
        if fresh:
            self._warn_other_layouts()
        foreign = self._foreign_description()
        self._write_layout_description(replace=foreign is not None)
        self._scan(drop_blocks=foreign)

    @property
    def capacity_blocks(self) -> int:
        """Blocks the tier holds at most."""
        return self._capacity

    @property
    def root(self) -> Path:
        """The directory holding this layout's block files."""
        return self._root

    def __len__(self) -> int:
        return len(self._index)

    def path_of(self, block_hash: bytes) -> Path:
        """The file that holds (or would hold) ``block_hash``'s record."""
        block_hash = check_block_hash(block_hash)
        if len(block_hash) > _MAX_HASH_BYTES:
            raise InvalidArgumentError(
                f"the disk tier takes block hashes of at most {_MAX_HASH_BYTES} bytes, "
                f"got {len(block_hash)}"
            )
        return self._root / (block_hash.hex() + _SUFFIX)

    def _describe(self, path: Path) -> dict[str, object] | None:
        """A ``layout.json``'s contents (None: absent, unreadable or not a regular file)."""
        try:
            f = _open_regular(path)
            if f is None:
                logger.warning(f"disk tier: {path} is not a regular file; ignored")
                return None
            with f:
                description = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return description if isinstance(description, dict) else None

    def _warn_other_layouts(self) -> None:
        """Say so when the directory holds blocks of other layouts only: a user who
        changed the model id, dtype or block size would otherwise see misses silently."""
        others = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._root.parent):
                if entry.is_dir() and entry.name != self._root.name:
                    description = self._describe(Path(entry.path) / "layout.json")
                    if description is not None:
                        digest = str(description.get("weights_digest") or "")[:16]
                        others.append(f"{description.get('model_id')!r} weights {digest}")
        if others:
            logger.warning(
                f"disk tier {self._root.parent}: no blocks of this layout ({self.layout}); "
                f"its blocks were stored by other layouts (model_id {'; '.join(sorted(others))}) "
                "and are never loaded into this one"
            )

    def _foreign_description(self) -> str | None:
        """The fingerprint a ``layout.json`` of this directory names when it is not this
        layout's (a directory copied or renamed from another model), else None."""
        description = self._describe(self._root / "layout.json")
        if description is None:
            return None
        named = description.get("fingerprint")
        if named == self.layout.fingerprint.hex():
            return None
        logger.warning(
            f"disk tier {self._root}: the directory describes another layout (fingerprint "
            f"{named}, model_id {description.get('model_id')!r}), not {self.layout}; its "
            "blocks are rejected and removed, never loaded"
        )
        return str(named)

    def _write_layout_description(self, *, replace: bool = False) -> None:
        path = self._root / "layout.json"
        if path.exists() and not replace:
            return
        description = {
            "fingerprint": self.layout.fingerprint.hex(),
            "model_id": self.layout.model_id,
            "weights_digest": self.layout.weights_digest,
            "trust_model_id": self.layout.trust_model_id,
            "num_layers": self.layout.num_layers,
            "num_kv_heads": self.layout.num_kv_heads,
            "block_size": self.layout.block_size,
            "head_size": self.layout.head_size,
            "dtype": str(self.layout.dtype),
            "payload_nbytes": self.layout.payload_nbytes,
        }
        tmp = path.with_name(f"layout.json.{os.getpid()}{_TMP_SUFFIX}")
        try:
            tmp.write_text(json.dumps(description, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError:
            # Only a description for people; a full disk must not stop the tier opening.
            tmp.unlink(missing_ok=True)

    def _scan(self, *, drop_blocks: str | None = None) -> None:
        found: list[tuple[int, bytes]] = []
        for entry in os.scandir(self._root):
            name = entry.name
            # A write that never reached its rename (a crash mid-put), or a block of the
            # foreign layout the directory described: every read would reject it.
            if name.endswith(_TMP_SUFFIX) or (drop_blocks is not None and name.endswith(_SUFFIX)):
                if not name.endswith(_TMP_SUFFIX):
                    self._stats.rejected += 1
                with contextlib.suppress(OSError):
                    Path(entry.path).unlink(missing_ok=True)
                continue
            if not name.endswith(_SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(name[: -len(_SUFFIX)])
                mtime = entry.stat().st_mtime_ns
                # A directory of a block's name is nothing this tier wrote or can read.
                if not entry.is_file():
                    continue
            except (ValueError, OSError):
                continue
            # A longer name is no block this tier wrote (path_of refuses its hash, so it
            # could never be read or evicted): leave it alone.
            if 0 < len(block_hash) <= _MAX_HASH_BYTES:
                found.append((mtime, block_hash))
        found.sort()
        for _, block_hash in found:
            self._index.insert(block_hash, 0)
        while len(self._index) > self._capacity:
            self._evict_lru()

    def _evict_lru(self, keep: bytes | None = None) -> bool:
        # ``keep``: never evict the block being rewritten to make room for itself.
        victim = self._index.victim(exclude=keep)
        if victim is None:
            return False
        self._index.remove(victim)
        self._unlink(victim)
        self._stats.evictions += 1
        return True

    def _unlink(self, block_hash: bytes) -> None:
        try:
            self.path_of(block_hash).unlink(missing_ok=True)
        except OSError:
            self._stats.errors += 1

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(message)

    def _write(self, path: Path, record: bytes) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{next(self._tmp_counter)}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(record)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise

    def put(self, block_hash: bytes, kv: Payload, *, priority: int = 0) -> bool:
        """Write one block's record (evicting LRU blocks while the tier or disk is full)."""
        path = self.path_of(block_hash)
        block_hash = check_block_hash(block_hash)
        priority = check_priority(priority)
        record = encode_block(self.layout, block_hash, kv, self._key)
        if block_hash not in self._index:
            while len(self._index) >= self._capacity:
                self._evict_lru()
        remade = False
        while True:
            try:
                self._write(path, record)
                break
            except OSError as exc:
                self._stats.errors += 1
                if exc.errno in _NO_SPACE and self._evict_lru(keep=block_hash):
                    continue
                if exc.errno == errno.ENOENT and not remade and self._remake_root():
                    remade = True
                    continue
                self._stats.dropped_puts += 1
                self._warn_once(f"disk tier {self._root}: a put failed and was dropped: {exc}")
                return False
        self._index.insert(block_hash, 0, priority)
        self._stats.puts += 1
        self._stats.bytes_in += self.layout.payload_nbytes
        return True

    def _remake_root(self) -> bool:
        """Make the block directory again when it was removed under the tier (a cleanup
        job): otherwise every later put would fail until a restart. The blocks it held
        are gone; the index still names them, and reading one unindexes it (a miss).
        Whether it exists now."""
        if self._root.is_dir():
            return False  # not what failed
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        logger.warning(f"disk tier {self._root}: the directory was removed; made again")
        self._write_layout_description()
        return True

    def put_many(
        self, block_hashes: Sequence[bytes], kvs: Sequence[Payload], *, priority: int = 0
    ) -> int:
        """Write several blocks; how many were stored (none when an argument is bad)."""
        for h in block_hashes:
            self.path_of(h)  # this tier's own limit on a hash's length, before any write
        return put_each(self, block_hashes, kvs, priority)

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each block's verified payload, or None (absent, or rejected and deleted)."""
        block_hashes = list(check_iterable(block_hashes, "block_hashes", "bytes"))
        paths = [self.path_of(h) for h in block_hashes]
        out: list[torch.Tensor | None] = []
        for path, raw_hash in zip(paths, block_hashes, strict=True):
            block_hash = bytes(raw_hash)
            if self._index.touch(block_hash) is None:
                self._stats.misses += 1
                out.append(None)
                continue
            payload = self._read(path, block_hash)
            if payload is None:
                self._stats.misses += 1
                out.append(None)
                continue
            self._stats.hits += 1
            self._stats.bytes_out += self.layout.payload_nbytes
            out.append(payload)
        return out

    def _read(self, path: Path, block_hash: bytes) -> torch.Tensor | None:
        try:
            f = _open_regular(path)
            if f is None:
                self._reject(block_hash, f"{path.name} is not a regular file")
                return None
            with f:
                # One byte past the longest record (a MAC'd one: a tier without the key
                # reads those too) rejects a longer file without reading it whole.
                data = bytearray(f.read(record_nbytes(self.layout, block_hash) + MAC_SIZE + 1))
        except FileNotFoundError:
            self._index.remove(block_hash)
            return None
        except OSError:
            self._stats.errors += 1
            return None
        try:
            decode_block(self.layout, block_hash, data, self._key)
        except CorruptBlockError as exc:
            if isinstance(exc, UnauthenticatedBlockError):
                self._stats.unauthenticated += 1
            self._reject(block_hash, str(exc))
            return None
        with contextlib.suppress(OSError):  # recency across restarts is best effort
            os.utime(path)
        return torch.frombuffer(
            data,
            dtype=torch.uint8,
            count=self.layout.payload_nbytes,
            offset=payload_offset(block_hash),
        )

    def _reject(self, block_hash: bytes, reason: str) -> None:
        """Count, warn about (once per tier), unindex and remove a block whose file holds
        no valid record."""
        self._stats.rejected += 1
        if not self._warned_rejected:
            self._warned_rejected = True
            logger.warning(
                f"disk tier {self._root}: a block record was rejected and removed ({reason}); "
                "such blocks read as misses"
            )
        self._index.remove(block_hash)
        self._unlink(block_hash)

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is indexed (its file is verified only when read)."""
        hashes = check_iterable(block_hashes, "block_hashes", "bytes")
        return [check_block_hash(h) in self._index for h in hashes]

    def evict(self, block_hash: bytes) -> bool:
        """Delete one block's file."""
        block_hash = check_block_hash(block_hash)
        if self._index.remove(block_hash) is None:
            return False
        self._unlink(block_hash)
        self._stats.evictions += 1
        return True

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        return self._stats.copy()

    def close(self) -> bool:
        """Forget the in-memory index; the files stay for the next open. True (no
        background work can outlive it)."""
        self._index = RetentionLRU()
        return True
