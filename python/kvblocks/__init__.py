"""kvblocks: a KV-cache block manager for LLM serving engines.

The block manager (:class:`KVCacheManager`) is compiled Rust; the GPU kernels live in
:mod:`kvblocks.ops` (CUDA through CuPy on a GPU, a torch reference on the CPU); the
continuous-batching scheduler in :mod:`kvblocks.scheduler` and the model runner in
:mod:`kvblocks.engine`; :class:`SamplingParams` describes one request's generation. Importing
kvblocks needs neither torch, CuPy nor a GPU.
"""

from kvblocks._core import (
    AllBlocksCleared,
    AllocStatus,
    BatchAllocation,
    BlockRemoved,
    BlockStored,
    GroupSpec,
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
from kvblocks.sampling_params import SamplingParams

__all__ = [
    "AllBlocksCleared",
    "AllocStatus",
    "BatchAllocation",
    "BlockRemoved",
    "BlockStored",
    "DuplicateSequenceError",
    "FlashAttentionPageTable",
    "FlashInferPageTable",
    "GroupSpec",
    "InvalidArgumentError",
    "InvariantViolationError",
    "KVBlocksError",
    "KVCacheManager",
    "OutOfBlocksError",
    "SamplingParams",
    "SequenceStateError",
    "UnknownSequenceError",
    "__version__",
]
