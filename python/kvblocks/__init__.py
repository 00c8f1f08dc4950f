"""kvblocks: a KV-cache block manager for LLM serving engines.

The block manager (:class:`KVCacheManager`) is compiled Rust; the GPU kernels live in
:mod:`kvblocks.ops` (CUDA through CuPy on a GPU, a torch reference on the CPU); the
continuous-batching scheduler in :mod:`kvblocks.scheduler` and the model runner in
:mod:`kvblocks.engine`. Importing kvblocks needs neither torch, CuPy nor a GPU.
"""

from kvblocks._core import (
    AllBlocksCleared,
    AllocStatus,
    BatchAllocation,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    __version__,
)
from kvblocks.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvariantViolationError,
    KVBlocksError,
    OutOfBlocksError,
    SequenceStateError,
    UnknownSequenceError,
)
from kvblocks.page_tables import FlashAttentionPageTable, FlashInferPageTable

__all__ = [
    "AllBlocksCleared",
    "AllocStatus",
    "BatchAllocation",
    "BlockRemoved",
    "BlockStored",
    "DuplicateSequenceError",
    "FlashAttentionPageTable",
    "FlashInferPageTable",
    "InvalidArgumentError",
    "InvariantViolationError",
    "KVBlocksError",
    "KVCacheManager",
    "OutOfBlocksError",
    "SequenceStateError",
    "UnknownSequenceError",
    "__version__",
]
