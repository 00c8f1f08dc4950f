"""Cache-aware request routing across instances.

Each instance's KV cache events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, as plain :mod:`~kvblocks.router.events` records) feed a
:class:`PrefixIndex` of block hash -> instances per tier; a :class:`PromptHasher` gives a
new request's block hashes exactly as the instances compute them; a router scores the
instances by matched prefix and load and picks one. :func:`records_from_wire` turns
vLLM-format events from a ZMQ subscriber into the same records.
"""

from kvblocks.router.events import (
    DEFAULT_MEDIUM,
    AllBlocksClearedRecord,
    BlockHash,
    BlockRemovedRecord,
    BlockStoredRecord,
    EventRecord,
    records_from_manager,
)
from kvblocks.router.hasher import PromptHasher
from kvblocks.router.index import PrefixIndex
from kvblocks.router.routers import (
    ROUTERS,
    CacheAwareRouter,
    InstanceLoad,
    LeastLoadedRouter,
    RoundRobinRouter,
    Router,
    make_router,
)
from kvblocks.router.wire import records_from_wire

__all__ = [
    "DEFAULT_MEDIUM",
    "ROUTERS",
    "AllBlocksClearedRecord",
    "BlockHash",
    "BlockRemovedRecord",
    "BlockStoredRecord",
    "CacheAwareRouter",
    "EventRecord",
    "InstanceLoad",
    "LeastLoadedRouter",
    "PrefixIndex",
    "PromptHasher",
    "RoundRobinRouter",
    "Router",
    "make_router",
    "records_from_manager",
    "records_from_wire",
]
