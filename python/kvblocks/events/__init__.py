"""KV-cache events over ZeroMQ in vLLM's wire format, for existing KV-aware routers.

:class:`ZmqEventPublisher` publishes :meth:`KVCacheManager.take_events` output as vLLM's
``ZmqEventPublisher`` does (PUB ``(topic, seq, payload)``, a ROUTER replay endpoint, msgpack
``KVEventBatch`` payloads), so vLLM's subscribers, llm-d's KV-cache indexer and Dynamo's ZMQ
relay read a kvblocks instance unchanged. Give one to ``Scheduler(..., event_publisher=)``
or ``LLM(..., event_publisher=)``. Needs the ``events`` extra (``pyzmq``, ``msgspec``).
"""

from kvblocks.events.publisher import (
    END_SEQ,
    NullEventPublisher,
    PublisherClosedError,
    ZmqEventPublisher,
)
from kvblocks.events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    to_wire_events,
)
from kvblocks.protocols import EventPublisher

__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "KVEventBatch",
    "NullEventPublisher",
    "PublisherClosedError",
    "ZmqEventPublisher",
    "to_wire_events",
]
