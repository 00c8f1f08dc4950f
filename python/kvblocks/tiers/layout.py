"""The byte layout of one KV block's payload, and the fingerprint that names it.

A payload holds a block's K and V for every layer, in the order ``layer 0 K, layer 0 V,
layer 1 K, ...``; each piece is one ``[num_kv_heads, block_size, head_size]`` tile of
:mod:`kvblocks.ops`' per-layer cache layout ``[num_blocks, num_kv_heads, block_size,
head_size]``, C-contiguous, in the cache's dtype. A payload is therefore exactly
``2 * num_layers`` contiguous tiles, and a tier stores it as ``payload_nbytes`` raw bytes.

The fingerprint hashes the weights' identity and every layout field, so that a stored block
is only ever loaded into a cache of the same weights and shape: tiers key blocks by
fingerprint plus block hash and reject a value whose header carries another fingerprint.
The identity is the digest of the weights themselves (:mod:`kvblocks.tiers.weights`), plus
an optional caller-given ``model_id``; a shared tier refuses a layout that names no
weights (:meth:`KVLayout.require_identity`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace

import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers.weights import WEIGHTS_DIGEST_SIZE
from kvblocks.validation import check_bool, check_int

__all__ = ["FINGERPRINT_SIZE", "KVLayout"]

#: Bytes of a layout fingerprint (a 128-bit BLAKE2b digest).
FINGERPRINT_SIZE = 16
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * WEIGHTS_DIGEST_SIZE}}}")


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and weights identity of the blocks a tier holds.

    Two engines share blocks only when every field agrees (the fingerprint hashes them all):

    - ``weights_digest``: the hex digest of the weights themselves (config and every
      tensor's name, shape, dtype and bytes; :func:`kvblocks.engine.weights_digest`, or
      the layout an ``LLM`` passes to a ``remote_tier`` factory, carries it). Two models
      whose shapes match but whose weights differ never share.
    - ``model_id``: any string the caller adds (a deployment, a tokenizer revision): an
      addition to the digest, never a replacement for it.
    - ``trust_model_id``: the opt-out, by name. True leaves the digest out of the
      fingerprint and names the weights by ``model_id`` alone (which must then be
      non-empty): for a user who knows that every engine sharing the tier under that id
      runs identical weights, e.g. to share between copies of a checkpoint that were
      converted or re-saved (another dtype on disk, another tensor order) and so hash
      differently. A wrong ``model_id`` then gives wrong tokens, without an error.

    - ``state_nbytes``: a recurrent hybrid's (Bamba's) bytes of one block's states (its
      ``L`` layer slots' conv then SSM state, float32); 0 for a model without recurrent
      layers. With it, a payload is as wide as the wider of the KV tiles and the states
      (a state group's block's payload is its states, padded), as the engine's host pool.

    A layout without a digest and without the opt-out describes bytes (a host pool, a
    transfer) but names no weights: shared tiers (:class:`~kvblocks.tiers.disk.DiskTier`,
    :class:`~kvblocks.tiers.valkey_tier.ValkeyTier`) refuse it.
    """

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    model_id: str = ""
    weights_digest: str = ""
    trust_model_id: bool = False
    state_nbytes: int = 0
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_size"):
            check_int(getattr(self, name), name, minimum=1, expected="a positive int")
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.model_id, str):
            raise InvalidArgumentError(f"model_id must be a str, got {self.model_id!r}")
        if not isinstance(self.weights_digest, str) or (
            self.weights_digest and not _HEX_DIGEST.fullmatch(self.weights_digest)
        ):
            raise InvalidArgumentError(
                f"weights_digest must be {2 * WEIGHTS_DIGEST_SIZE} lowercase hex digits or "
                f"empty, got {self.weights_digest!r}"
            )
        check_bool(self.trust_model_id, "trust_model_id")
        check_int(self.state_nbytes, "state_nbytes", minimum=0, expected="an int >= 0")
        if self.trust_model_id and not self.model_id:
            raise InvalidArgumentError(
                "trust_model_id=True names the weights by model_id alone: model_id must not "
                "be empty"
            )
        weights = "" if self.trust_model_id else self.weights_digest
        fields = [
            "kvblocks-layout-v2",
            weights,
            self.model_id,
            self.trust_model_id,
            self.num_layers,
            self.num_kv_heads,
            self.block_size,
            self.head_size,
            str(self.dtype),
        ]
        if self.state_nbytes:
            # Only a recurrent model's layout names states: the others' fingerprints stay.
            fields.append(["states", self.state_nbytes])
        text = json.dumps(fields, separators=(",", ":"))
        digest = hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_SIZE).digest()
        object.__setattr__(self, "fingerprint", digest)

    @property
    def has_identity(self) -> bool:
        """Whether the layout names the weights (a digest, or ``trust_model_id``)."""
        return bool(self.weights_digest) or self.trust_model_id

    def require_identity(self, user: str) -> None:
        """Raise InvalidArgumentError naming ``user`` unless :attr:`has_identity`: a tier
        shared between engines never shares under an empty identity."""
        if not self.has_identity:
            raise InvalidArgumentError(
                f"{user} is shared between engines, so its layout must name the weights: "
                "give weights_digest (kvblocks.engine.weights_digest(model), or let LLM "
                "build the store: remote_tier=lambda layout: ...(layout, ...)), or "
                "model_id with trust_model_id=True (the opt-out: the id alone names them)"
            )

    def shape_only(self) -> KVLayout:
        """This layout without any identity (the bytes it describes, nothing more)."""
        return replace(self, model_id="", weights_digest="", trust_model_id=False)

    @classmethod
    def from_caches(
        cls,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        model_id: str = "",
        *,
        weights_digest: str = "",
        trust_model_id: bool = False,
    ) -> KVLayout:
        """The layout of a per-layer ``[(key_cache, value_cache), ...]`` list (identity
        fields as in the constructor)."""
        if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
            raise InvalidArgumentError("kv_caches must be a non-empty list of (key, value) pairs")
        for layer, pair in enumerate(kv_caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidArgumentError(f"kv_caches[{layer}] must be a (key, value) pair")
            for cache in pair:
                if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                    got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else cache
                    raise InvalidArgumentError(
                        f"kv_caches[{layer}]: a cache must be a tensor [num_blocks, "
                        f"num_kv_heads, block_size, head_size], got {got!r}"
                    )
        key = kv_caches[0][0]
        for layer, pair in enumerate(kv_caches):
            for cache in pair:
                # A payload holds one tile shape and dtype for every layer, K and V.
                if cache.shape[1:] != key.shape[1:] or cache.dtype != key.dtype:
                    raise InvalidArgumentError(
                        f"kv_caches[{layer}] {tuple(cache.shape)} {cache.dtype} differs from "
                        f"layer 0's {tuple(key.shape)} {key.dtype} in tile shape or dtype"
                    )
        _, heads, block_size, head_size = key.shape
        return cls(
            len(kv_caches),
            int(heads),
            int(block_size),
            int(head_size),
            key.dtype,
            model_id,
            weights_digest,
            trust_model_id,
        )

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V) tile of a block."""
        return (self.num_kv_heads, self.block_size, self.head_size)

    @property
    def tile_nbytes(self) -> int:
        """Bytes of one layer's K (or V) tile of a block."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * self.block_size * self.head_size * itemsize

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one block's payload: K and V tiles for every layer (or a block's
        states, when wider: ``state_nbytes``)."""
        return max(2 * self.num_layers * self.tile_nbytes, self.state_nbytes)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of one block's K and V tiles for every layer (the payload without the
        padding a wider state adds)."""
        return 2 * self.num_layers * self.tile_nbytes
