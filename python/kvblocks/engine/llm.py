"""``LLM``: offline batch generation with the paged engine.

A thin facade over three parts, as in vLLM's v1 engine: the
:class:`~kvblocks.engine.input_processor.InputProcessor` checks a call's prompts and
parameters and builds its requests, the :class:`~kvblocks.engine.engine_core.EngineCore`
runs the steps (schedule -> execute -> update, with the remote tier's admission), and the
:class:`~kvblocks.engine.output_processor.OutputProcessor` turns each step's records into
the stream's. :meth:`LLM.generate` returns the final outputs, :meth:`LLM.stream` yields
every step's progress (token and text deltas), and :meth:`LLM.abort` ends a request
mid-stream. What the engine is built from (device, model, cache sizes, remote tier) is
:mod:`~kvblocks.engine.build`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from kvblocks import KVCacheManager, ops
from kvblocks.engine import build
from kvblocks.engine.engine_core import EngineCore
from kvblocks.engine.input_processor import InputProcessor
from kvblocks.engine.models import CausalLM
from kvblocks.engine.output_processor import OutputProcessor
from kvblocks.engine.outputs import GenerationOutput
from kvblocks.engine.prompts import Prompt
from kvblocks.engine.runner import ModelRunner, kv_block_bytes
from kvblocks.engine.stream_state import RequestRun
from kvblocks.engine.tokenizer import Tokenizer, load_tokenizer
from kvblocks.errors import InvalidArgumentError, InvalidTypeError, OutOfBlocksError
from kvblocks.protocols import EventPublisher, RemoteTier
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import Scheduler, SchedulerConfig
from kvblocks.tiers.remote_link import RemoteTierLink, RemoteTierOptions
from kvblocks.validation import check_bool, check_optional_int, check_request_id

__all__ = ["LLM", "Prompt"]


class LLM:
    """A paged-attention engine for the supported decoders (:mod:`kvblocks.engine.models`).

    Args:
        model: ``None`` for the built-in tiny model, a Hugging Face checkpoint directory,
            or an already built :class:`~kvblocks.engine.models.CausalLM`.
        tokenizer: overrides the tokenizer found with the model (``tokenizer.json`` in the
            directory; bytes for the tiny model).
        num_blocks: device KV-cache blocks, the null block included. Default: 85% of the
            free GPU memory on CUDA; up to 256 MiB of cache (at most 4096 blocks) on CPU.
            With KV cache groups (``kv_cache_groups``) a block holds ``L`` layer slots,
            not every layer: the same ``num_blocks`` is ``L / n_layers`` of the memory
            (the default, sized in bytes, is ``n_layers / L`` times as many blocks).
        block_size: tokens per block: 8, 16 or 32.
        num_cpu_blocks: CPU swap-space blocks for swap preemption. Default: as many
            as ``num_blocks`` but at most 4 GiB.
        enable_prefix_caching: share cached prompt prefixes between requests.
        max_num_batched_tokens, max_num_seqs: per-step limits of the scheduler.
        preemption_mode: ``None`` (recompute single-sequence requests, swap
            multi-sequence ones), ``"recompute"`` or ``"swap"``.
        policy: ``"fcfs"``, ``"priority"`` or ``"lpm"``.
        enable_chunked_prefill: split long prompts across steps.
        device: default CUDA when torch sees a GPU and CuPy is installed, else CPU.
        dtype: default float32 on CPU; the checkpoint's float16/bfloat16 (else
            bfloat16) on CUDA.
        seed: seed of the engine's sampling generator (and of the tiny model's weights).
        max_model_len: most tokens a sequence may hold, prompt and generated tokens
            together; default the model's ``max_position_embeddings`` (the most it
            allows). A longer prompt (or one that leaves no room for a token) is
            rejected; generation stops there with ``finish_reason="length"``.
        host_cache_blocks: slots of a host tier below the device pool (0: none; needs
            prefix caching). A cached prefix block evicted from the device pool is kept
            there, and a later prompt with that prefix loads it back instead of recomputing
            it; the runner owns the pool (pinned on CUDA). The tier's counters are the
            ``host_*`` keys of ``stats()["cache"]``.
        host_offload: when a block is copied to the tier: ``"evict"`` (when its device
            block is reused) or ``"commit"`` (write-through, when it enters the prefix
            cache). See docs/scheduler-engine-interface.md, "Host tier".
        remote_tier: a shared store below the host tier (a
            :class:`~kvblocks.tiers.valkey_tier.ValkeyTier` whose ``KVLayout`` has this
            engine's cache shape and dtype and names its weights: the ``weights_digest`` of
            :func:`~kvblocks.engine.weights_digest`, or ``trust_model_id``; needs
            ``host_cache_blocks > 0``). Every block offloaded to the host
            tier is also written there (``host_offload="commit"`` writes every computed
            block), and a new prompt's blocks past this instance's own hit are read from it
            and loaded instead of recomputed: instances sharing the server share prefixes.
            A dead server or a rejected value reads as a miss (recompute). A
            :class:`~kvblocks.tiers.disk.DiskTier` works the same way (a directory that
            survives restarts). The caller closes it; :meth:`close` ends the engine's
            background I/O. See :mod:`kvblocks.tiers.remote_link`. A callable instead is
            called once with the engine's :class:`~kvblocks.tiers.layout.KVLayout` (its
            ``weights_digest`` set, its ``model_id`` empty: the callable may add one) and
            returns the store (``kvblocks generate`` builds its tier this way, its layout
            known only once the model is loaded). The weights are hashed for this once
            (a checkpoint's digest is cached in ``$KVBLOCKS_WEIGHTS_CACHE``, see
            :mod:`kvblocks.tiers.weights`).
        remote_tier_options: a
            :class:`~kvblocks.tiers.remote_link.RemoteTierOptions`: store calls on a
            background thread (the default: writes queued and bounded, a new request's
            read prefetched while other requests run) or on the step thread.
        event_publisher: a KV-event publisher (e.g.
            :class:`kvblocks.events.ZmqEventPublisher`); the manager then records events
            and each step's are published. The caller closes it.
        state_checkpoint_blocks: a hybrid recurrent model (Bamba) only: blocks between
            the cached states of its mixers (a prefix hit ends on such a boundary);
            default 512 tokens' worth. Its manager has one attention group and
            recurrent-state groups (:mod:`~kvblocks.engine.layer_groups`); its host
            tier keeps the states of cached checkpoints like KV blocks (a row holds a
            block's KV or its states, by the block's group), and so do the records of
            its remote tier (``KVLayout.state_nbytes``).
        kv_cache_groups: a model mixing sliding-window and full-attention layers (Gemma
            2/3, gpt-oss, Ministral, Qwen3, OLMo 3), or chunked local and full ones
            (Llama 4), gets one KV cache group per attention kind
            (:func:`~kvblocks.engine.layer_groups.attention_layout`): a window group's
            blocks that slid out of view, a chunked group's past chunks, go back to the
            pool, and the cache keeps ``L`` layer slots per block, not one per layer (a
            block then costs ``L`` layers' KV, see ``num_blocks``); a remote tier keys
            each group's blocks by group and hash. ``False`` keeps one full-attention
            group of every layer, each window layer masking its window (a chunked layer
            still reads its chunk only). A model of one attention kind always has one
            group (unless its layers are chunked: one chunked group).

    Raises:
        InvalidArgumentError: a bad argument, or a device torch cannot use (unknown, no
            CUDA GPU, no CuPy for the CUDA kernels).
    """

    def __init__(
        self,
        model: str | Path | CausalLM | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        num_cpu_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        preemption_mode: str | None = None,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        host_cache_blocks: int = 0,
        host_offload: Literal["evict", "commit"] = "evict",
        event_publisher: EventPublisher | None = None,
        remote_tier: RemoteTier | None = None,
        remote_tier_options: RemoteTierOptions | None = None,
        state_checkpoint_blocks: int | None = None,
        kv_cache_groups: bool = True,
    ) -> None:
        _check_arguments(model, tokenizer, num_blocks, num_cpu_blocks)
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, (int, np.integer))
            or block_size not in ops.SUPPORTED_BLOCK_SIZES
        ):
            raise InvalidArgumentError(
                f"block_size must be one of {ops.SUPPORTED_BLOCK_SIZES}, got {block_size!r}"
            )
        build.check_remote_tier(remote_tier, remote_tier_options)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=policy,
            preemption_mode=preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        dev = build.resolve_device(device)
        # The weights' identity keys what a shared tier holds: a checkpoint's is read from
        # its files before they are loaded, and checked unchanged once they are.
        on_disk = build.weights_before_load(model, remote_tier)
        self.model = build.build_model(model, dev, dtype, seed)
        param = next(self.model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.tokenizer: Tokenizer | None = tokenizer
        if tokenizer is None and not isinstance(model, CausalLM):
            self.tokenizer = load_tokenizer(model)
        config = self.model.config
        self.eos_token_ids = config.eos_token_ids
        self.max_model_len = build.check_max_model_len(
            max_model_len, config.max_position_embeddings
        )
        layout = build.recurrent_layout(self.model, block_size, state_checkpoint_blocks)
        attention = build.attention_groups(self.model, kv_cache_groups)
        num_blocks, num_cpu_blocks = build.cache_sizes(
            num_blocks,
            num_cpu_blocks,
            self.device,
            kv_block_bytes(
                self.model,
                block_size,
                self.dtype,
                None if attention is None else attention.layers_per_group,
            )
            + build.state_bytes(self.model, layout),
        )
        groups = layout.groups() if layout is not None else None
        if attention is not None:
            groups = attention.groups()
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=None if groups is not None else config.uniform_sliding_window(),
            groups=groups,
            # Without a publisher nothing drains them: they would pile up.
            record_events=event_publisher is not None,
            host_cache_blocks=host_cache_blocks,
            host_offload=host_offload,
        )
        self.scheduler = Scheduler(self.manager, scheduler_config, event_publisher=event_publisher)
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=block_size,
            num_cpu_blocks=num_cpu_blocks,
            host_cache_blocks=self.manager.host_cache_blocks,
            seed=seed,
            layout=layout,
            attention_layout=attention,
            tier_slot_groups=self.manager.tier_slot_groups,
        )
        self.remote: RemoteTierLink | None = None
        if remote_tier is not None:
            self.remote = build.connect_remote_tier(
                remote_tier, remote_tier_options, on_disk, self.model, self.manager, self.runner
            )
        self._core = EngineCore(self.manager, self.scheduler, self.runner, self.remote)
        self._inputs = InputProcessor(
            self.tokenizer, config.vocab_size, self.max_model_len, self.eos_token_ids
        )
        self._outputs = OutputProcessor(self.tokenizer)
        self._run_stats: dict[str, int | float] = {}

    # -- generation ----------------------------------------------------------------------
    @overload
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
        stream: Literal[False] = False,
    ) -> list[GenerationOutput]: ...

    @overload
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
        stream: Literal[True],
    ) -> Iterator[GenerationOutput]: ...

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
        stream: bool = False,
    ) -> list[GenerationOutput] | Iterator[GenerationOutput]:
        """Generate completions for every prompt; results come back in prompt order.

        Args:
            prompts: one prompt or a list (text and token-id prompts can be mixed); a
                prompt may be a dict, ``{"prompt": text}`` or ``{"prompt_token_ids":
                ids}``, with a ``"cache_salt"`` and a ``"lora_id"``: prompts share cached
                blocks (here and through a remote tier) only within one salt and one LoRA
                id, so tenants of one engine never read each other's KV (see
                :mod:`kvblocks.engine.prompts`).
            sampling_params: one for all prompts, or one per prompt; default
                ``SamplingParams()``.
            priority: one for all prompts or one per prompt; smaller is served first
                when the engine was built with ``policy="priority"`` (ignored otherwise).
            stream: return :meth:`stream`'s iterator instead of the final outputs.

        Raises:
            InvalidArgumentError: a bad prompt or parameter (nothing is queued then).
            OutOfBlocksError: the engine stopped making progress (a pool too small for
                what was asked, e.g. no CPU blocks for a beam search that must swap).
        """
        if check_bool(stream, "stream"):
            return self.stream(prompts, sampling_params, priority=priority)
        runs = self._prepare(prompts, sampling_params, priority)
        final: dict[str, GenerationOutput] = {}
        for out in self._run(runs):
            if out.finished:
                final[out.request_id] = out
        results = [final[run.request.request_id] for run in runs]
        for result in results:
            for c in result.outputs:  # a whole result: everything is new
                c.new_token_ids = list(c.token_ids)
                c.new_text = c.text
        return results

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
    ) -> Iterator[GenerationOutput]:
        """Generate like :meth:`generate`, yielding each request's progress step by step.

        Every engine step yields one :class:`GenerationOutput` per request that moved:
        its completions (all that have started, ordered by index) with the cumulative
        ``token_ids``/``text`` and this step's ``new_token_ids``/``new_text``; the last
        record of a request has ``finished`` True and is what :meth:`generate` returns
        for it. Beam search yields only that last record. :meth:`abort` may be called
        between two records (the aborted request's last record follows). Leaving the
        loop early aborts what is unfinished.

        Arguments are checked (and ``InvalidArgumentError`` raised) here, before the
        first record, the scheduler's limits included (``n``/``beam_width`` a step holds);
        the requests are queued when the iteration starts, where a prompt the pool can
        never hold is refused.
        """
        runs = self._prepare(prompts, sampling_params, priority)
        return self._run(runs)

    def _prepare(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None,
    ) -> list[RequestRun]:
        """The call's requests, checked against the scheduler's limits too (sequences a
        step holds, a prompt over the budget with chunked prefill off) before anything is
        queued: ``stream`` raises here, not when its iteration starts."""
        runs = self._inputs.prepare(prompts, sampling_params, priority)
        for run in runs:
            self.scheduler.config.check_request(run.request)
        return runs

    def abort_request(self, request_id: str) -> GenerationOutput | None:
        """Abort a request of the running :meth:`stream` (``GenerationOutput.request_id``)
        and return its last record, with ``finish_reason="abort"`` for its unfinished
        completions; None for an unknown or already finished request.

        Call it from the loop that consumes the stream: the same record is also the
        stream's next one. A request still held for its remote-tier read never reaches the
        scheduler: its record has every completion empty.

        Raises:
            InvalidTypeError: ``request_id`` is not a string.
        """
        run = self._outputs.active(check_request_id(request_id))
        if run is None:
            return None
        if self._core.withdraw(request_id) is not None:
            record = OutputProcessor.unscheduled_abort(run)
        else:
            aborted = self._core.abort_request(request_id)
            if aborted is None:
                return None
            record = aborted
        return self._outputs.add_aborted(record, self.scheduler)

    def _run(self, runs: list[RequestRun]) -> Iterator[GenerationOutput]:
        """Queue ``runs`` and step until they finish, yielding each step's records."""
        if self._outputs.runs:
            raise InvalidArgumentError(
                "another generate()/stream() of this LLM is still running; finish or close it first"
            )
        core, outputs = self._core, self._outputs
        outputs.begin(runs)
        core.begin_call()
        start = time.perf_counter()
        steps = computed = 0
        try:
            core.add_requests(run.request for run in runs)
            while any(not run.finished for run in runs):
                yield from outputs.take_aborted()
                step = core.step(outputs)
                if step is None:
                    break
                steps += 1
                computed += step.num_tokens
                outputs.begin_step(step.logprobs)
                for record in step.records:
                    yield from outputs.emit(record, step.logprobs, self.scheduler)
                    # An abort called on that record is the stream's next record, before
                    # the rest of the step's (the aborted request's is then skipped).
                    yield from outputs.take_aborted()
                if step.preempted:
                    core.track_preempted(outputs)
            yield from outputs.take_aborted()
            missing = [r.request.request_id for r in runs if not r.finished]
            if missing:
                raise OutOfBlocksError(f"requests {missing} never finished")
        finally:
            # Whatever stopped the loop (an error, Ctrl-C, a consumer leaving the stream),
            # nothing of this call may stay queued: the next call must find an idle,
            # consistent engine.
            try:
                core.end_call([r.request.request_id for r in runs if not r.finished])
            finally:
                outputs.end()
            elapsed = time.perf_counter() - start
            generated = sum(len(c.tokens) for r in runs for c in r.completions.values())
            self._run_stats = {
                "steps": steps,
                "computed_tokens": computed,
                "generated_tokens": generated,
                "elapsed_s": elapsed,
                "generated_tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            }
            if self.remote is not None:
                # A call's blocks are in the store when it returns (a bounded wait, not
                # counted in elapsed_s: the steps did not wait for it).
                self.remote.flush()

    # -- statistics ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Statistics: ``engine`` (last generate call), ``scheduler`` and ``cache`` counters.

        With a ``remote_tier``, ``remote`` holds the engine's ``imported_blocks`` and
        ``published_blocks`` and the store's counters (``hits``, ``misses``, ``rejected``,
        ``puts``, ``dropped_puts``, ...).

        With a host tier ``cache`` also holds the tier's counters (``host_hits`` in tokens,
        ``host_loads``, ``host_offloads``, ``host_offloads_skipped``, ``host_evictions``,
        ``num_host_cached_blocks``, ...: ``KVCacheManager.stats()``).

        Counts are ints, rates and times floats. ``engine["generated_tokens"]`` counts the
        tokens of the returned completions; the scheduler's ``num_generated_tokens`` counts
        every sampled token, so with beam search it also includes the tokens of discarded
        beams.
        """
        stats: dict[str, Any] = {
            "engine": dict(self._run_stats),
            "scheduler": self.scheduler.stats(),
            "cache": dict(self.manager.stats()),
        }
        if self.remote is not None:
            stats["remote"] = {**vars(self.remote.stats()), **vars(self.remote.store.stats())}
        return stats

    # -- lifetime ------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> bool:
        """End the engine's background remote-tier I/O: queued writes reach the store
        within ``timeout`` (default ``RemoteTierOptions.close_timeout_s``), later ones are
        dropped; whether the thread ended in time. The store itself stays open (its owner
        closes it). Without a remote tier there is nothing to end."""
        if self.remote is None:
            return True
        return self.remote.close(timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_arguments(
    model: object, tokenizer: object, num_blocks: object, num_cpu_blocks: object
) -> None:
    """Raise unless the constructor's model, tokenizer and pool sizes have their types
    (each failed later as a TypeError from ``Path()`` or a comparison, or, a tokenizer,
    as an AttributeError on the first text prompt)."""
    if model is not None and not isinstance(model, (str, os.PathLike, CausalLM)):
        raise InvalidTypeError(
            f"model must be a path, a CausalLM or None, got {type(model).__name__}"
        )
    if tokenizer is not None and not (
        callable(getattr(tokenizer, "encode", None))
        and callable(getattr(tokenizer, "decode", None))
    ):
        raise InvalidTypeError(
            f"tokenizer must have encode() and decode(), got {type(tokenizer).__name__}"
        )
    check_optional_int(num_blocks, "num_blocks", numpy=True)
    check_optional_int(num_cpu_blocks, "num_cpu_blocks", numpy=True)
