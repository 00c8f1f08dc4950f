"""The weights digest: what it depends on, what it does not, and its cache.

Checkpoints are real safetensors files written by the engine's own writer; the cache is
checked against in-place rewrites that keep a file's name, size and modification time,
the case a cache keyed on path, size and whole-second mtime gets wrong.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers import KVLayout, weights
from kvblocks.tiers.weights import (
    CACHE_ENV,
    RACY_WINDOW_NS,
    checkpoint_digest,
    tensors_digest,
    weights_cache_dir,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

OLD_NS = 1_600_000_000 * 10**9  # long before any test runs: not "racy"
CONFIG = {"model_type": "llama", "hidden_size": 8}


@pytest.fixture(autouse=True)
def _no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files here were written a moment ago (their change time is now, and no call can
    set it back): without a racy window their digests are cached at once."""
    monkeypatch.setattr(weights, "RACY_WINDOW_NS", 0)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 8, generator=gen),
        "b.bias": torch.randn(8, generator=gen).to(torch.bfloat16),
        "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }


def _write(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> list[Path]:
    """A checkpoint: config.json and ``shards`` safetensors files, dated OLD_NS."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(tensors)
    files = []
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        path = directory / f"model-{i}.safetensors"
        safetensors_torch.save_file(part, str(path))
        files.append(path)
    for f in directory.iterdir():
        os.utime(f, ns=(OLD_NS, OLD_NS))
    return files


def _digest(directory: Path, files: list[Path], cache: Path) -> tuple[str, bool]:
    result = checkpoint_digest(directory / "config.json", files, cache_dir=cache)
    return result.digest, result.cached


def test_the_state_dict_digest_sees_every_field() -> None:
    base = tensors_digest(_tensors(), CONFIG)
    assert base == tensors_digest(_tensors(), dict(reversed(CONFIG.items())))
    assert len(base) == 64 and int(base, 16) >= 0
    changed = []
    t = _tensors()
    t["a.weight"][1, 2] += 1e-6
    changed.append(t)
    t = _tensors()
    t["a.weight"] = t["a.weight"].reshape(8, 4)  # same bytes, another shape
    changed.append(t)
    t = _tensors()
    t["c.ids"] = t["c.ids"].view(torch.float64)  # same bytes, another dtype
    changed.append(t)
    t = _tensors()
    t["a.weigh"] = t.pop("a.weight")  # same bytes, another name
    changed.append(t)
    t = _tensors()
    t["d.extra"] = torch.zeros(0)
    changed.append(t)
    digests = {tensors_digest(t, CONFIG) for t in changed}
    digests.add(tensors_digest(_tensors(), {**CONFIG, "hidden_size": 9}))
    assert base not in digests and len(digests) == len(changed) + 1
    # A non-contiguous or strided view hashes as its values.
    wide = torch.randn(8, 8)
    assert tensors_digest({"w": wide[:, ::2]}, {}) == tensors_digest(
        {"w": wide[:, ::2].contiguous()}, {}
    )


def test_a_checkpoint_digest_is_that_of_its_tensors_in_any_sharding(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    one, _ = _digest(tmp_path / "one", _write(tmp_path / "one", _tensors()), cache)
    three, _ = _digest(tmp_path / "three", _write(tmp_path / "three", _tensors(), 3), cache)
    other, _ = _digest(tmp_path / "other", _write(tmp_path / "other", _tensors(1)), cache)
    assert one == three == tensors_digest(_tensors(), CONFIG)
    assert other != one


def test_the_cache_answers_an_unchanged_checkpoint(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    files = _write(tmp_path / "m", _tensors())
    first = _digest(tmp_path / "m", files, cache)
    assert first[1] is False and len(list(cache.glob("*.json"))) == 1
    assert _digest(tmp_path / "m", files, cache) == (first[0], True)
    # A copy elsewhere is looked up under its own paths, and hashes the same.
    copy = _write(tmp_path / "copy", _tensors())
    assert _digest(tmp_path / "copy", copy, cache) == (first[0], False)


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_a_rewrite_with_the_same_size_and_mtime_is_seen(tmp_path: Path, how: str) -> None:
    """New weights under the same name, size and modification time (in place: same inode;
    replaced: a new file renamed over it) are hashed again, never answered from the cache."""
    cache = tmp_path / "cache"
    files = _write(tmp_path / "m", _tensors(0))
    old, _ = _digest(tmp_path / "m", files, cache)
    before = files[0].stat()
    new_bytes = tmp_path / "new.safetensors"
    safetensors_torch.save_file(_tensors(1), str(new_bytes))
    if how == "in place":
        with open(files[0], "r+b") as f:
            f.write(new_bytes.read_bytes())
    else:
        os.replace(new_bytes, files[0])
    os.utime(files[0], ns=(OLD_NS, OLD_NS))
    after = files[0].stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    new, cached = _digest(tmp_path / "m", files, cache)
    assert not cached and new != old and new == tensors_digest(_tensors(1), CONFIG)


def test_a_freshly_written_checkpoint_is_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file changed within the racy window could be rewritten within the same timestamp
    tick unnoticed: its digest is computed again each time until it is older (its change
    time is now, even with its modification time set back)."""
    monkeypatch.setattr(weights, "RACY_WINDOW_NS", RACY_WINDOW_NS)
    cache = tmp_path / "cache"
    files = _write(tmp_path / "m", _tensors())
    assert _digest(tmp_path / "m", files, cache)[1] is False
    assert _digest(tmp_path / "m", files, cache)[1] is False
    assert not list(cache.glob("*.json"))


def test_an_unusable_cache_is_skipped(tmp_path: Path) -> None:
    files = _write(tmp_path / "m", _tensors())
    want = tensors_digest(_tensors(), CONFIG)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert _digest(tmp_path / "m", files, blocked) == (want, False)
    cache = tmp_path / "cache"
    _digest(tmp_path / "m", files, cache)
    for entry in cache.glob("*.json"):
        entry.write_text('{"format": 1, "stamps": "garbage", "digest": 7}')
    assert _digest(tmp_path / "m", files, cache) == (want, False)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        assert _digest(tmp_path / "m", files, ro / "cache") == (want, False)


def test_a_read_only_checkpoint_is_hashed_and_cached_elsewhere(tmp_path: Path) -> None:
    files = _write(tmp_path / "m", _tensors())
    for f in [*files, tmp_path / "m" / "config.json"]:
        f.chmod(stat.S_IRUSR)
    (tmp_path / "m").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        cache = tmp_path / "cache"
        assert _digest(tmp_path / "m", files, cache)[1] is False
        assert _digest(tmp_path / "m", files, cache)[1] is True
    finally:
        (tmp_path / "m").chmod(stat.S_IRWXU)


def test_the_cache_directory_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "here"))
    assert weights_cache_dir() == tmp_path / "here"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights_cache_dir() == tmp_path / "xdg" / "kvblocks" / "weights"


_PAST_END = b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (b"", "shorter than its header"),
        ((10**9).to_bytes(8, "little") + b"{}", "runs past the end"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
        ((2).to_bytes(8, "little") + b"{x", "not JSON"),
        (len(_PAST_END).to_bytes(8, "little") + _PAST_END, "outside the file"),
    ],
)
def test_a_file_that_is_not_safetensors_is_one_error(
    tmp_path: Path, damage: bytes, message: str
) -> None:
    files = _write(tmp_path / "m", _tensors())
    files[0].write_bytes(damage)
    with pytest.raises(InvalidArgumentError, match=message):
        _digest(tmp_path / "m", files, tmp_path / "cache")


def test_a_tensor_in_two_shards_and_a_missing_file_are_errors(tmp_path: Path) -> None:
    files = _write(tmp_path / "m", _tensors())
    with pytest.raises(InvalidArgumentError, match="in both"):
        _digest(tmp_path / "m", [files[0], files[0]], tmp_path / "cache")
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        _digest(tmp_path / "m", [tmp_path / "m" / "absent.safetensors"], tmp_path / "cache")


def test_a_checkpoint_that_keeps_changing_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _write(tmp_path / "m", _tensors())
    real = weights._hash_checkpoint

    def rewriting(config_file: Path, weight_files: list[Path]) -> str:
        digest = real(config_file, weight_files)
        os.utime(weight_files[0])  # a writer is still at work
        return digest

    monkeypatch.setattr(weights, "_hash_checkpoint", rewriting)
    with pytest.raises(InvalidArgumentError, match="changed while it was hashed"):
        _digest(tmp_path / "m", files, tmp_path / "cache")


def test_a_layout_names_its_weights() -> None:
    digest = tensors_digest(_tensors(), CONFIG)
    plain = KVLayout(2, 2, 16, 64, torch.float16)
    named = KVLayout(2, 2, 16, 64, torch.float16, weights_digest=digest)
    tagged = KVLayout(2, 2, 16, 64, torch.float16, "tenant", digest)
    trusted = KVLayout(2, 2, 16, 64, torch.float16, "tenant", digest, trust_model_id=True)
    trusted_other = KVLayout(2, 2, 16, 64, torch.float16, "tenant", trust_model_id=True)
    assert not plain.has_identity and named.has_identity and trusted.has_identity
    prints = {x.fingerprint for x in (plain, named, tagged, trusted)}
    assert len(prints) == 4
    # The opt-out leaves the digest out of the fingerprint: the id alone names the weights.
    assert trusted.fingerprint == trusted_other.fingerprint
    for bad in (
        {"weights_digest": "ab"},
        {"weights_digest": digest.upper()},
        {"weights_digest": 1},
    ):
        with pytest.raises(InvalidArgumentError, match="weights_digest"):
            KVLayout(2, 2, 16, 64, torch.float16, **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="model_id must not be empty"):
        KVLayout(2, 2, 16, 64, torch.float16, trust_model_id=True)
    with pytest.raises(InvalidArgumentError, match="trust_model_id must be a bool"):
        KVLayout(2, 2, 16, 64, torch.float16, "x", trust_model_id=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="name the weights"):
        plain.require_identity("a test tier")
