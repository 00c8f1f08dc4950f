"""Hostile arguments to the Python-level APIs outside the ops: remote tier options and
``LLM(remote_tier=...)``, the tiers' constructors, the ZMQ event publisher, the routers
and the scheduler's configuration.

Each row is a call with one bad argument; it must raise InvalidArgumentError (or a
TypeError where a non-path is given as a path) naming that argument, at the call: never an
AttributeError, OverflowError, AssertionError or a backend's error later, and never
silent acceptance. Rejected calls on a live object leave it working.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from kvblocks import SamplingParams
from kvblocks.engine import LLM
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.events.publisher import ZmqEventPublisher
from kvblocks.router import (
    CacheAwareRouter,
    InstanceLoad,
    LeastLoadedRouter,
    RoundRobinRouter,
    make_router,
)
from kvblocks.scheduler import Request, SchedulerConfig
from kvblocks.tiers import RemoteTierOptions
from kvblocks.tiers.disk import DiskTier
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.valkey_tier import ValkeyTier

BIG = 2**70
NAN = float("nan")
INF = float("inf")
LAYOUT = KVLayout(2, 2, 16, 64, torch.float16, "hostile", trust_model_id=True)
ANY_PORT = "tcp://127.0.0.1:*"


def _cache(heads: int = 2, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(4, heads, 16, 64, dtype=dtype)


# (row id, call, a word the message must contain)
ROWS = [
    # RemoteTierOptions: a wait past threading.TIMEOUT_MAX raises OverflowError inside
    ("options fetch_wait_s inf", lambda: RemoteTierOptions(fetch_wait_s=INF), "fetch_wait_s"),
    ("options fetch_wait_s nan", lambda: RemoteTierOptions(fetch_wait_s=NAN), "fetch_wait_s"),
    (
        "options close_timeout_s 1e300",
        lambda: RemoteTierOptions(close_timeout_s=1e300),
        "close_timeout_s",
    ),
    (
        "options close_timeout_s str",
        lambda: RemoteTierOptions(close_timeout_s="5"),
        "close_timeout_s",
    ),
    (
        "options max_pending_write_blocks 0",
        lambda: RemoteTierOptions(max_pending_write_blocks=0),
        "max_pending_write_blocks",
    ),
    ("options async_io int", lambda: RemoteTierOptions(async_io=1), "async_io"),
    # KVLayout.from_caches
    ("from_caches None pair", lambda: KVLayout.from_caches([(None, None)]), "kv_caches"),
    ("from_caches not pairs", lambda: KVLayout.from_caches([1]), "kv_caches"),
    ("from_caches not a list", lambda: KVLayout.from_caches(_cache()), "kv_caches"),
    (
        "from_caches layers differ",
        lambda: KVLayout.from_caches([(_cache(), _cache()), (_cache(1), _cache(1))]),
        "kv_caches",
    ),
    (
        "from_caches value dtype differs",
        lambda: KVLayout.from_caches([(_cache(), _cache(dtype=torch.float32))]),
        "kv_caches",
    ),
    ("KVLayout num_layers True", lambda: KVLayout(True, 2, 16, 64, torch.float16), "num_layers"),
    # ValkeyTier: the client connects lazily, so these would only read as an outage
    (
        "KVLayout weights_digest short",
        lambda: KVLayout(2, 2, 16, 64, torch.float16, weights_digest="ab"),
        "weights_digest",
    ),
    (
        "KVLayout trust without an id",
        lambda: KVLayout(2, 2, 16, 64, torch.float16, trust_model_id=True),
        "model_id",
    ),
    (
        "valkey layout names no weights",
        lambda: ValkeyTier(KVLayout(2, 2, 16, 64, torch.float16, "only-an-id")),
        "weights",
    ),
    ("valkey port -1", lambda: ValkeyTier(LAYOUT, port=-1), "port"),
    ("valkey port 70000", lambda: ValkeyTier(LAYOUT, port=70000), "port"),
    ("valkey port str", lambda: ValkeyTier(LAYOUT, port="6379"), "port"),
    ("valkey host None", lambda: ValkeyTier(LAYOUT, host=None), "host"),
    ("valkey url int", lambda: ValkeyTier(LAYOUT, url=5), "url"),
    ("valkey key_prefix bytes", lambda: ValkeyTier(LAYOUT, key_prefix=b"kv:"), "key_prefix"),
    (
        "valkey socket_timeout_s nan",
        lambda: ValkeyTier(LAYOUT, socket_timeout_s=NAN),
        "socket_timeout_s",
    ),
    (
        "valkey socket_timeout_s inf",
        lambda: ValkeyTier(LAYOUT, socket_timeout_s=INF),
        "socket_timeout_s",
    ),
    (
        "valkey socket_timeout_s str",
        lambda: ValkeyTier(LAYOUT, socket_timeout_s="1"),
        "socket_timeout_s",
    ),
    (
        "valkey retry_interval_s nan",
        lambda: ValkeyTier(LAYOUT, retry_interval_s=NAN),
        "retry_interval_s",
    ),
    ("valkey ttl_s True", lambda: ValkeyTier(LAYOUT, ttl_s=True), "ttl_s"),
    # The client's own URL errors were ValueErrors (the CLI caught them for --valkey-url).
    ("valkey url scheme", lambda: ValkeyTier(LAYOUT, url="http://h:6379/0"), "url"),
    ("valkey url empty", lambda: ValkeyTier(LAYOUT, url=""), "url"),
    ("valkey url port 99999", lambda: ValkeyTier(LAYOUT, url="valkey://h:99999/0"), "url"),
    ("valkey url port abc", lambda: ValkeyTier(LAYOUT, url="valkey://h:abc/0"), "url"),
    ("valkey url db abc", lambda: ValkeyTier(LAYOUT, url="valkey://h:1/0?db=abc"), "url"),
    ("valkey url ipv6", lambda: ValkeyTier(LAYOUT, url="valkey://[::1"), "url"),
    # The client ignores a database path that is no number: the tier used db 0, silently.
    ("valkey url db path abc", lambda: ValkeyTier(LAYOUT, url="valkey://h:1/abc"), "url"),
    ("valkey url db path -1", lambda: ValkeyTier(LAYOUT, url="valkey://h:1/-1"), "url"),
    ("valkey batch_size True", lambda: ValkeyTier(LAYOUT, batch_size=True), "batch_size"),
    # ZmqEventPublisher: every check before the first socket
    ("zmq endpoint None", lambda: ZmqEventPublisher(None), "endpoint"),
    ("zmq endpoint int", lambda: ZmqEventPublisher(5557), "endpoint"),
    (
        "zmq replay_endpoint int",
        lambda: ZmqEventPublisher(ANY_PORT, replay_endpoint=5558),
        "replay_endpoint",
    ),
    (
        "zmq buffer_steps 2^70",
        lambda: ZmqEventPublisher(ANY_PORT, buffer_steps=BIG),
        "buffer_steps",
    ),
    ("zmq hwm 2^40", lambda: ZmqEventPublisher(ANY_PORT, hwm=2**40), "hwm"),
    ("zmq topic bytes", lambda: ZmqEventPublisher(ANY_PORT, topic=b"kv"), "topic"),
    (
        "zmq data_parallel_rank -1",
        lambda: ZmqEventPublisher(ANY_PORT, data_parallel_rank=-1),
        "data_parallel_rank",
    ),
    (
        "zmq data_parallel_rank str",
        lambda: ZmqEventPublisher(ANY_PORT, data_parallel_rank="0"),
        "data_parallel_rank",
    ),
    ("zmq context int", lambda: ZmqEventPublisher(ANY_PORT, context=5), "context"),
    ("zmq bind str", lambda: ZmqEventPublisher(ANY_PORT, bind="yes"), "bind"),
    # routers
    ("router num_instances True", lambda: RoundRobinRouter(True), "num_instances"),
    ("router num_instances 2.5", lambda: LeastLoadedRouter(2.5), "num_instances"),
    ("router num_instances str", lambda: CacheAwareRouter("3"), "num_instances"),
    ("router num_instances 2^40", lambda: RoundRobinRouter(2**40), "num_instances"),
    (
        "router prefill_weight inf",
        lambda: LeastLoadedRouter(2, prefill_weight=INF),
        "prefill_weight",
    ),
    (
        "router prefill_weight str",
        lambda: CacheAwareRouter(2, prefill_weight="8"),
        "prefill_weight",
    ),
    (
        "router tier_credit nan",
        lambda: CacheAwareRouter(2, tier_credit={"GPU": NAN}),
        "tier_credit",
    ),
    ("router tier_credit 2", lambda: CacheAwareRouter(2, tier_credit={"CPU": 2.0}), "tier_credit"),
    ("router tier_credit key", lambda: CacheAwareRouter(2, tier_credit={5: 0.5}), "tier_credit"),
    ("router tier_credit int", lambda: CacheAwareRouter(2, tier_credit=5), "tier_credit"),
    ("router index int", lambda: CacheAwareRouter(2, index=5), "index"),
    ("make_router list", lambda: make_router(["cache-aware"], 2), "router"),
    ("InstanceLoad nan", lambda: InstanceLoad(active_blocks=NAN), "active_blocks"),
    (
        "InstanceLoad negative",
        lambda: InstanceLoad(queued_prefill_blocks=-1),
        "queued_prefill_blocks",
    ),
    # SchedulerConfig and retention priorities
    (
        "config max_load_blocks_per_step 2^70",
        lambda: SchedulerConfig(max_load_blocks_per_step=BIG),
        "max_load_blocks_per_step",
    ),
    (
        "config max_load_blocks_per_step True",
        lambda: SchedulerConfig(max_load_blocks_per_step=True),
        "max_load_blocks_per_step",
    ),
    (
        "config num_lookahead_tokens 2^70",
        lambda: SchedulerConfig(num_lookahead_tokens=BIG),
        "num_lookahead_tokens",
    ),
    ("config max_num_seqs 2^70", lambda: SchedulerConfig(max_num_seqs=BIG), "max_num_seqs"),
    ("config policy list", lambda: SchedulerConfig(policy=["fcfs"]), "policy"),
    (
        "Request retention_priority 101",
        lambda: Request("r", [1, 2], retention_priority=101),
        "retention_priority",
    ),
    (
        "Request retention_priority True",
        lambda: Request("r", [1, 2], retention_priority=True),
        "retention_priority",
    ),
    (
        "SamplingParams retention_priority 50.0",
        lambda: SamplingParams(retention_priority=50.0),
        "retention_priority",
    ),
    (
        "SamplingParams retention_priority -1",
        lambda: SamplingParams(retention_priority=-1),
        "retention_priority",
    ),
]


@pytest.mark.parametrize(("call", "word"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_is_named(call, word):
    threads = threading.active_count()
    with pytest.raises(InvalidArgumentError, match=word):
        call()
    assert threading.active_count() == threads, "a rejected call left a thread running"


def test_disk_tier_arguments(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(InvalidArgumentError, match="capacity_blocks"):
        DiskTier(tmp_path, LAYOUT, True)
    with pytest.raises(TypeError, match="directory"):
        DiskTier(None, LAYOUT, 4)
    with pytest.raises(InvalidArgumentError, match="directory"):
        DiskTier(afile, LAYOUT, 4)  # a file where the directory goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"], "nothing was created"


def test_zmq_rejection_opens_nothing():
    """A rejected publisher leaves no socket behind: the context still terminates."""
    ctx = zmq.Context()
    for kwargs in ({"buffer_steps": BIG}, {"hwm": 2**40}, {"replay_endpoint": 1}):
        with pytest.raises(InvalidArgumentError):
            ZmqEventPublisher(ANY_PORT, context=ctx, **kwargs)
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(5.0), "a socket of a rejected publisher kept the context alive"


@pytest.mark.parametrize("cls", [RoundRobinRouter, LeastLoadedRouter, CacheAwareRouter])
def test_router_rejections_keep_its_state(cls):
    """Bad route/set_load arguments raise named errors; the rotation and loads are kept."""
    reference, router = cls(3), cls(3)
    bad = [
        (lambda: router.route((), -1), "num_prompt_blocks"),
        (lambda: router.route((), NAN), "num_prompt_blocks"),
        (lambda: router.route((), True), "num_prompt_blocks"),
        (lambda: router.route(None, 3), "block_hashes"),
        (lambda: router.route(b"abc", 3), "block_hashes"),
        (lambda: router.route([1, 2, 3], 1), "block hashes"),
        (lambda: router.route([[1]], 3), "block_hashes"),
        (lambda: router.set_load(0, 5), "load"),
        (lambda: router.set_load("0", InstanceLoad()), "instance"),
        (lambda: router.set_load(3, InstanceLoad()), "instance"),
    ]
    for call, word in bad:
        with pytest.raises(InvalidArgumentError, match=word):
            call()
    assert router.loads == reference.loads
    assert [router.route((), 1) for _ in range(4)] == [reference.route((), 1) for _ in range(4)]


def test_llm_remote_tier_arguments(tmp_path):
    model = build_tiny_model(tiny_config("llama"))
    engine = {"num_blocks": 16, "block_size": 16, "num_cpu_blocks": 0, "host_cache_blocks": 4}
    with pytest.raises(InvalidArgumentError, match="remote_tier_options"):
        LLM(model, remote_tier_options={"async_io": False}, **engine)
    with pytest.raises(InvalidArgumentError, match="remote_tier_options"):
        LLM(model, remote_tier_options=RemoteTierOptions(), **engine)  # no tier to apply to
    with pytest.raises(InvalidArgumentError, match="remote_tier"):
        LLM(model, remote_tier="valkey://localhost", **engine)
    with pytest.raises(InvalidArgumentError, match="TierStore"):
        LLM(model, remote_tier=lambda layout: None, **engine)  # a factory returning nothing

    def disk(layout: KVLayout) -> DiskTier:
        return DiskTier(tmp_path, layout, 8)

    llm = LLM(model, remote_tier=disk, remote_tier_options=RemoteTierOptions(), **engine)
    assert llm.remote is not None
    for timeout in (INF, "1", -1.0, NAN):  # inf first: unchecked, it raises OverflowError
        with pytest.raises(InvalidArgumentError, match="timeout"):
            llm.close(timeout)
        with pytest.raises(InvalidArgumentError, match="timeout"):
            llm.remote.flush(timeout)
    # The rejected closes let nothing go: the engine still generates and writes through.
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([list(range(1, 40))], params)[0].outputs[0].token_ids) == 2
    assert llm.close(5.0)


def test_remote_tier_link_arguments(tmp_path):
    """RemoteTierLink names a manager, host pool or layout of the wrong kind at
    construction (each was an AttributeError there, or a pool of the wrong shape or
    dtype failed only in the first fetch's write, read as a miss)."""
    from kvblocks import KVCacheManager
    from kvblocks.tiers.remote_link import RemoteTierLink
    from kvblocks.tiers.transfer import allocate_host_pool

    layout = KVLayout(2, 2, 16, 64, torch.float16, "hostile", weights_digest="ab" * 32)
    store = DiskTier(tmp_path, layout, 8)
    manager = KVCacheManager(16, 16, host_cache_blocks=4)
    pool = allocate_host_pool(layout, 4, pin_memory=False)
    width = layout.payload_nbytes
    options = RemoteTierOptions(async_io=False)
    for args, word in (
        ((store, None, pool, layout), "manager"),
        ((store, "manager", pool, layout), "manager"),
        ((store, manager, 5, layout), "host_pool"),
        ((store, manager, torch.zeros(4, width), layout), "host_pool"),
        ((store, manager, torch.zeros(4, 3, dtype=torch.uint8), layout), "host_pool"),
        ((store, manager, torch.zeros(2, width, dtype=torch.uint8), layout), "host_pool"),
        (
            (store, manager, torch.zeros(4, width, dtype=torch.uint8, device="meta"), layout),
            "host_pool",
        ),
        ((store, manager, pool, None), "layout"),
        ((store, manager, pool, "layout"), "layout"),
    ):
        with pytest.raises(InvalidArgumentError, match=word):
            RemoteTierLink(*args, options)
    RemoteTierLink(store, manager, pool, layout, options).close()


def test_text_prompt_that_is_no_unicode_text():
    """A lone surrogate (what a command line's undecodable bytes become) was a
    UnicodeEncodeError out of the tokenizer; the engine keeps working after it."""
    llm = LLM(None, num_blocks=16, block_size=16, num_cpu_blocks=0)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        llm.generate(["ok", "bad \udcff"], params)
    assert len(llm.generate(["ok"], params)[0].outputs[0].token_ids) == 2
    llm.close()


def test_disk_tier_empty_directory(tmp_path, monkeypatch):
    """An empty path was the current directory: kvblocks generate --disk-tier '' wrote
    its tier into wherever it ran."""
    monkeypatch.chdir(tmp_path)  # where a regression would write
    with pytest.raises(InvalidArgumentError, match="directory"):
        DiskTier("", LAYOUT, 4)
    assert list(tmp_path.iterdir()) == [], "nothing was created"


def test_empty_model_path(tmp_path, monkeypatch):
    """An empty model path was the current directory (kvblocks generate --model '' loaded
    whatever checkpoint was there); it is refused by name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="model path is empty"):
        LLM("", num_blocks=16)
