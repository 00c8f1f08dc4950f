"""The identity of a model's weights: one digest of its config and every tensor.

A shared tier must never hand one model's KV to another, and two checkpoints with the same
shapes are indistinguishable by their layout alone. :func:`tensors_digest` hashes a state
dict and :func:`checkpoint_digest` a safetensors checkpoint directory, both as one
canonical stream (BLAKE3, through the compiled core)::

    "kvblocks-weights-v1\\0"
    field(config as canonical JSON: sorted keys, no spaces)
    for each tensor, by name: field(JSON [name, dtype, shape]), field(its raw bytes)

where ``field(x)`` is ``x``'s length as a little-endian u64, then ``x``; dtypes are
safetensors' names (``"F32"``, ``"BF16"``, ...). The digest does not depend on how a
checkpoint is sharded, where it lives or what its files are called, so two copies of one
checkpoint share, and any change to a value, a shape, a dtype, a name or the config gives
another digest.

Hashing a checkpoint reads every byte of it (see the README's "Shared Valkey tier" for
measured times), so its digest is cached in kvblocks' own cache directory
(``$KVBLOCKS_WEIGHTS_CACHE``, else ``$XDG_CACHE_HOME/kvblocks/weights``, else
``~/.cache/kvblocks/weights``; the checkpoint directory itself may be read-only), keyed by
each file's path, size, modification and change times in nanoseconds, inode and device. A
file rewritten in place keeps its path and inode and may keep its size and even its
modification time (within the file system's timestamp granularity, or set back by
``cp -p``/``rsync -t``), but not its change time, which no user call can set; and a digest
is only cached for files last changed more than :data:`RACY_WINDOW_NS` before hashing
began, so a rewrite within one timestamp tick of the hashed version is never mistaken for
it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvblocks._core import Blake3
from kvblocks.errors import InvalidArgumentError

__all__ = [
    "CACHE_ENV",
    "RACY_WINDOW_NS",
    "WEIGHTS_DIGEST_SIZE",
    "CheckpointDigest",
    "FileStamp",
    "checkpoint_digest",
    "tensors_digest",
    "weights_cache_dir",
]

logger = logging.getLogger(__name__)

#: Bytes of a weights digest (hex strings are twice as long).
WEIGHTS_DIGEST_SIZE = 32
#: Environment variable naming the directory where checkpoint digests are cached.
CACHE_ENV = "KVBLOCKS_WEIGHTS_CACHE"
#: A file changed less than this long before hashing began is hashed again next time:
#: coarser than any file system's timestamp granularity (FAT's is 2 s).
RACY_WINDOW_NS = 3_000_000_000

_MAGIC = b"kvblocks-weights-v1\0"
_CACHE_FORMAT = 1
_U64 = struct.Struct("<Q")
# Hashing a checkpoint that keeps changing gives up after this many tries.
_TRIES = 3

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class _Stream:
    """The canonical framing of a digest (see the module docstring)."""

    def __init__(self) -> None:
        self._hasher = Blake3()
        self._hasher.update(_MAGIC)

    def field(self, data: bytes | np.ndarray) -> None:
        size = len(data) if isinstance(data, bytes) else int(data.nbytes)
        self._hasher.update(_U64.pack(size))
        self._hasher.update(data)

    def config(self, config: Mapping[str, Any]) -> None:
        try:
            text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"a model config must be JSON data: {exc}") from None
        self.field(text.encode())

    def tensor(self, name: str, dtype: str, shape: Sequence[int], data: np.ndarray) -> None:
        self.field(json.dumps([name, dtype, list(shape)], separators=(",", ":")).encode())
        self.field(data)

    def hexdigest(self) -> str:
        return self._hasher.digest(WEIGHTS_DIGEST_SIZE).hex()


def tensors_digest(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> str:
    """The weights digest (hex) of a state dict and its model config.

    Device tensors are copied to the CPU one at a time. Raises InvalidArgumentError for a
    name that is not a str, a value that is not a tensor, or a config that is not JSON data.
    """
    stream = _Stream()
    stream.config(config)
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"a state dict maps str to torch.Tensor, got {name!r}: {type(tensor).__name__}"
            )
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype, str(tensor.dtype))
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        stream.tensor(name, dtype, tuple(tensor.shape), flat.numpy())
    return stream.hexdigest()


@dataclass(frozen=True)
class FileStamp:
    """What identifies one version of a file without reading it."""

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        """The stamp of ``path`` now (OSError when it cannot be stat'ed)."""
        st = path.stat()
        return cls(str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True)
class CheckpointDigest:
    """A checkpoint's weights digest and the versions of the files it was computed from.

    ``cached``: read from the cache rather than computed now.
    """

    digest: str
    stamps: tuple[FileStamp, ...]
    cached: bool

    def unchanged(self) -> bool:
        """Whether every file is still the version that was hashed (call it after loading
        the weights: a checkpoint rewritten meanwhile is not the one the digest names)."""
        try:
            return _stamps(self.stamps) == self.stamps
        except OSError:
            return False


def weights_cache_dir() -> Path:
    """Where checkpoint digests are cached (``$KVBLOCKS_WEIGHTS_CACHE``, else
    ``$XDG_CACHE_HOME/kvblocks/weights``, else ``~/.cache/kvblocks/weights``)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvblocks" / "weights"


def _stamps(stamps: Sequence[FileStamp]) -> tuple[FileStamp, ...]:
    return tuple(FileStamp.of(Path(s.path)) for s in stamps)


def checkpoint_digest(
    config_file: str | os.PathLike[str],
    weight_files: Sequence[str | os.PathLike[str]],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> CheckpointDigest:
    """The weights digest of a checkpoint: its ``config.json`` and safetensors files.

    Looked up in the cache (``cache_dir``, default :func:`weights_cache_dir`) by the files'
    stamps; otherwise every file is read and hashed, and the digest is cached when the
    files are old enough to be told apart from a later rewrite (see the module docstring).
    A cache that cannot be read or written is skipped (logged at debug level).

    Raises:
        InvalidArgumentError: a file that cannot be read, a config that is not JSON, a
            weight file that is not safetensors, a tensor name in two files, or files that
            kept changing while they were hashed.
    """
    paths = [Path(config_file).resolve(), *(Path(f).resolve() for f in weight_files)]
    if len(paths) < 2:
        raise InvalidArgumentError("a checkpoint needs at least one weight file")
    cache = Path(cache_dir) if cache_dir is not None else weights_cache_dir()
    entry = cache / (
        hashlib.blake2b("\0".join(map(str, paths)).encode()).hexdigest()[:40] + ".json"
    )
    for _ in range(_TRIES):
        started = time.time_ns()
        before = _read_stamps(paths)
        cached = _cached_digest(entry, before)
        if cached is not None:
            return CheckpointDigest(cached, before, cached=True)
        digest = _hash_checkpoint(paths[0], paths[1:])
        if _read_stamps(paths) != before:
            continue  # rewritten while it was read: the digest names no single version
        if all(max(s.mtime_ns, s.ctime_ns) < started - RACY_WINDOW_NS for s in before):
            _store_digest(entry, before, digest)
        return CheckpointDigest(digest, before, cached=False)
    raise InvalidArgumentError(
        f"checkpoint {paths[0].parent} changed while it was hashed, {_TRIES} times; "
        "load it once it is completely written"
    )


def _read_stamps(paths: Sequence[Path]) -> tuple[FileStamp, ...]:
    try:
        return tuple(FileStamp.of(p) for p in paths)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the checkpoint: {exc}") from None


def _cached_digest(entry: Path, stamps: tuple[FileStamp, ...]) -> str | None:
    try:
        record = json.loads(entry.read_text())
        if (
            record["format"] == _CACHE_FORMAT
            and [tuple(s) for s in record["stamps"]] == [astuple(s) for s in stamps]
            and isinstance(record["digest"], str)
            and len(record["digest"]) == 2 * WEIGHTS_DIGEST_SIZE
        ):
            return record["digest"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.debug("weights digest cache entry %s unusable: %s", entry, exc)
    return None


def _store_digest(entry: Path, stamps: tuple[FileStamp, ...], digest: str) -> None:
    record = {"format": _CACHE_FORMAT, "stamps": [astuple(s) for s in stamps], "digest": digest}
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, entry)
    except OSError as exc:  # a read-only home: the digest is simply computed next time
        logger.debug("weights digest not cached in %s: %s", entry.parent, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class _TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: int
    begin: int
    end: int


def _safetensors_entries(path: Path, index: int, size: int) -> list[_TensorEntry]:
    """The tensors a safetensors file's header lists, their byte ranges checked."""
    bad = f"{path} is not a safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InvalidArgumentError(f"{bad} (shorter than its header)")
        (header_len,) = _U64.unpack(head)
        if header_len > size - 8:
            raise InvalidArgumentError(f"{bad} (its header runs past the end)")
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise InvalidArgumentError(f"{bad} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise InvalidArgumentError(f"{bad} (its header is not a JSON object)")
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgumentError(f"{bad} (tensor {name!r} is described wrongly)") from None
        if not 0 <= begin <= end <= size - base:
            raise InvalidArgumentError(f"{bad} (tensor {name!r} lies outside the file)")
        entries.append(_TensorEntry(name, dtype, shape, index, base + begin, base + end))
    return entries


def _hash_checkpoint(config_file: Path, weight_files: Sequence[Path]) -> str:
    try:
        config = json.loads(config_file.read_text())
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {config_file}: {exc}") from None
    except ValueError as exc:
        raise InvalidArgumentError(f"{config_file} is not valid JSON: {exc}") from None
    stream = _Stream()
    stream.config(config if isinstance(config, dict) else {"": config})
    entries: list[_TensorEntry] = []
    for i, path in enumerate(weight_files):
        try:
            entries += _safetensors_entries(path, i, path.stat().st_size)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {path}: {exc}") from None
    entries.sort(key=lambda e: e.name)
    for prev, entry in itertools.pairwise(entries):
        if prev.name == entry.name:
            raise InvalidArgumentError(
                f"tensor {entry.name!r} is in both {weight_files[prev.file].name} and "
                f"{weight_files[entry.file].name}"
            )
    with contextlib.ExitStack() as stack:
        views: list[np.ndarray] = []
        try:
            for path in weight_files:
                f = stack.enter_context(open(path, "rb"))
                if os.fstat(f.fileno()).st_size == 0:
                    views.append(np.zeros(0, np.uint8))
                    continue
                mapped = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                views.append(np.frombuffer(mapped, dtype=np.uint8))
            truncated = _hash_tensors(stream, entries, views)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the checkpoint: {exc}") from None
        finally:
            # A map cannot close while an array still views it: _hash_tensors returns
            # (its frame, holding views, is gone; a raise would keep it in the traceback).
            views.clear()
    if truncated is not None:
        raise InvalidArgumentError(f"{weight_files[truncated]} changed while it was read")
    return stream.hexdigest()


def _hash_tensors(
    stream: _Stream, entries: Sequence[_TensorEntry], views: Sequence[np.ndarray]
) -> int | None:
    """Hash every tensor's bytes; the index of a file shorter than its header says (it was
    truncated since), else None."""
    for entry in entries:
        view = views[entry.file]
        if entry.end > view.size:
            return entry.file
        stream.tensor(entry.name, entry.dtype, entry.shape, view[entry.begin : entry.end])
    return None
