"""``LLM``: offline batch generation with the paged engine.

Wires the pieces together: a model (the built-in tiny one, a checkpoint directory or a
model object), the Rust :class:`kvblocks.KVCacheManager`, the continuous-batching
:class:`kvblocks.scheduler.Scheduler` and the :class:`~kvblocks.engine.runner.ModelRunner`,
then loops schedule -> execute -> update until every prompt has finished:
:meth:`LLM.generate` returns the final outputs, :meth:`LLM.stream` yields every step's
progress (token and text deltas), and :meth:`LLM.abort` ends a request mid-stream.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from kvblocks import KVCacheManager, ops
from kvblocks.engine.loader import load_checkpoint
from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.outputs import GenerationOutput
from kvblocks.engine.remote_tier import PendingFetch, RemoteTierLink, RemoteTierOptions
from kvblocks.engine.runner import ModelRunner, kv_block_bytes
from kvblocks.engine.stream_state import RequestRun, StepLogprobs
from kvblocks.engine.tiny import build_tiny_model
from kvblocks.engine.tokenizer import Tokenizer, load_tokenizer
from kvblocks.errors import InvalidArgumentError, OutOfBlocksError
from kvblocks.sampling_params import SamplingParams, as_token_ids
from kvblocks.scheduler import (
    FinishReason,
    ModelStepResult,
    Request,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from kvblocks.tiers.store import TierStore

__all__ = ["LLM", "Prompt"]

Prompt = str | Sequence[int] | np.ndarray
"""A text prompt (needs a tokenizer) or a prompt of token ids."""

_CPU_DEFAULT_CACHE_BYTES = 256 << 20
_CPU_DEFAULT_MAX_BLOCKS = 4096
_DEFAULT_SWAP_BYTES = 4 << 30
_GPU_CACHE_FRACTION = 0.85
# Steps in a row that compute nothing and move nothing before generate() gives up.
_MAX_IDLE_STEPS = 64


def _default_device() -> torch.device:
    if torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None:
        return torch.device("cuda")
    return torch.device("cpu")


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """The engine's device; anything but a usable CPU or CUDA device is a one-line error."""
    if device is None:
        return _default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"unknown device {str(device)!r}; expected 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidArgumentError(
            f"device {str(device)!r} is not supported; expected 'cpu', 'cuda' or 'cuda:N'"
        )
    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device {str(device)!r}: torch sees no CUDA GPU (torch.cuda.is_available() is "
            "False); use --device cpu"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and not 0 <= dev.index < count:
        raise InvalidArgumentError(
            f"device {str(device)!r}: there are {count} CUDA devices (cuda:0..cuda:{count - 1})"
        )
    if importlib.util.find_spec("cupy") is None:
        raise InvalidArgumentError(
            f"device {str(device)!r}: the CUDA kernels need CuPy "
            "(pip install 'kvblocks[cuda12]' or 'kvblocks[cuda13]')"
        )
    return dev


def _default_dtype(model_dtype: str | None, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32
    if model_dtype in ("float16", "bfloat16"):
        return getattr(torch, model_dtype)
    return torch.bfloat16


class LLM:
    """A paged-attention engine for Llama, Mistral and Qwen2 models.

    Args:
        model: ``None`` for the built-in tiny model, a Hugging Face checkpoint directory,
            or an already built :class:`~kvblocks.engine.model.LlamaForCausalLM`.
        tokenizer: overrides the tokenizer found with the model (``tokenizer.json`` in the
            directory; bytes for the tiny model).
        num_blocks: device KV-cache blocks, the null block included. Default: 85% of the
            free GPU memory on CUDA; up to 256 MiB of cache (at most 4096 blocks) on CPU.
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
            engine's cache shape and dtype, and a ``model_id`` naming the weights; needs
            ``host_cache_blocks > 0``). Every block offloaded to the host
            tier is also written there (``host_offload="commit"`` writes every computed
            block), and a new prompt's blocks past this instance's own hit are read from it
            and loaded instead of recomputed: instances sharing the server share prefixes.
            A dead server or a rejected value reads as a miss (recompute). A
            :class:`~kvblocks.tiers.disk.DiskTier` works the same way (a directory that
            survives restarts). The caller closes it; :meth:`close` ends the engine's
            background I/O. See :mod:`kvblocks.engine.remote_tier`. A callable instead is
            called once with the engine's :class:`~kvblocks.tiers.layout.KVLayout` (its
            ``model_id`` empty) and returns the store (``kvblocks generate`` builds its
            tier this way, its layout known only once the model is loaded).
        remote_tier_options: a
            :class:`~kvblocks.engine.remote_tier.RemoteTierOptions`: store calls on a
            background thread (the default: writes queued and bounded, a new request's
            read prefetched while other requests run) or on the step thread.
        event_publisher: a KV-event publisher (e.g.
            :class:`kvblocks.events.ZmqEventPublisher`); the manager then records events
            and each step's are published. The caller closes it.

    Raises:
        InvalidArgumentError: a bad argument, or a device torch cannot use (unknown, no
            CUDA GPU, no CuPy for the CUDA kernels).
    """

    def __init__(
        self,
        model: str | Path | LlamaForCausalLM | None = None,
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
        event_publisher: Any | None = None,
        remote_tier: Any | None = None,
        remote_tier_options: RemoteTierOptions | None = None,
    ) -> None:
        if block_size not in ops.SUPPORTED_BLOCK_SIZES:
            raise InvalidArgumentError(
                f"block_size must be one of {ops.SUPPORTED_BLOCK_SIZES}, got {block_size!r}"
            )
        # Checked before the model is built: a wrong object fails at once, and options
        # given without a tier are a mistake, not something to ignore.
        if remote_tier_options is not None and not isinstance(
            remote_tier_options, RemoteTierOptions
        ):
            raise InvalidArgumentError(
                "remote_tier_options must be RemoteTierOptions or None, got "
                f"{type(remote_tier_options).__name__}"
            )
        if remote_tier is None and remote_tier_options is not None:
            raise InvalidArgumentError("remote_tier_options given without a remote_tier")
        if remote_tier is not None and not (
            isinstance(remote_tier, TierStore) or callable(remote_tier)
        ):
            raise InvalidArgumentError(
                "remote_tier must be a TierStore (e.g. ValkeyTier) or a factory taking the "
                f"host layout, got {type(remote_tier).__name__}"
            )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=policy,
            preemption_mode=preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        dev = _resolve_device(device)
        self.model = self._build_model(model, dev, dtype, seed)
        param = next(self.model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.tokenizer: Tokenizer | None = tokenizer
        if tokenizer is None and not isinstance(model, LlamaForCausalLM):
            self.tokenizer = load_tokenizer(model)
        config = self.model.config
        self.eos_token_ids = config.eos_token_ids
        self.max_model_len = _check_max_model_len(max_model_len, config.max_position_embeddings)
        block_bytes = kv_block_bytes(self.model, block_size, self.dtype)
        if num_blocks is None:
            num_blocks = self._default_num_blocks(block_bytes)
        if num_cpu_blocks is None:
            num_cpu_blocks = min(num_blocks, max(1, _DEFAULT_SWAP_BYTES // block_bytes))
        if num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}"
            )
        if num_cpu_blocks < 0:
            raise InvalidArgumentError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=config.uniform_sliding_window(),
            # Without a publisher nothing drains them: they would pile up.
            record_events=event_publisher is not None,
            host_cache_blocks=host_cache_blocks,
            host_offload=host_offload,
        )
        self._scheduler_config = scheduler_config
        self._event_publisher = event_publisher
        self.scheduler = Scheduler(self.manager, scheduler_config, event_publisher=event_publisher)
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=block_size,
            num_cpu_blocks=num_cpu_blocks,
            host_cache_blocks=self.manager.host_cache_blocks,
            seed=seed,
        )
        self.remote: RemoteTierLink | None = None
        if remote_tier is not None:
            if callable(remote_tier) and not isinstance(remote_tier, TierStore):
                # A factory: the store's layout is only known once the model is built.
                remote_tier = remote_tier(self.runner.host_layout)
            self.remote = RemoteTierLink(
                remote_tier,
                self.manager,
                self.runner.host_pool,
                self.runner.host_layout,
                remote_tier_options,
            )
        # Requests of the running call held back until their prefetch came back (or its
        # wait ran out), in arrival order: (run, read or None).
        self._pending: deque[tuple[RequestRun, PendingFetch | None, float]] = deque()
        # Sequences preempted by recompute, waiting for re-admission: (request id,
        # completion index) -> (tokens to recompute, blocks missing at the last probe).
        self._readmit: dict[tuple[str, int], tuple[list[int], int | None]] = {}
        self._next_request = 0
        self._mid_step = False  # between schedule() and update() (see _run)
        self._runs: dict[str, RequestRun] = {}  # the running call's requests
        self._aborted: list[RequestOutput] = []  # abort() records not yielded yet
        self.run_stats: dict[str, int | float] = {}

    @staticmethod
    def _build_model(
        model: str | Path | LlamaForCausalLM | None,
        device: torch.device,
        dtype: torch.dtype | None,
        seed: int,
    ) -> LlamaForCausalLM:
        if isinstance(model, LlamaForCausalLM):
            if dtype is not None or device != next(model.parameters()).device:
                model = model.to(device=device, dtype=dtype)
            return model.eval()
        if model is None:
            return build_tiny_model(
                seed=seed, device=device, dtype=dtype or _default_dtype(None, device)
            )
        from kvblocks.engine.config import ModelConfig

        if not Path(model).is_dir():
            raise InvalidArgumentError(
                f"model path {model} is not a directory; expected a Hugging Face checkpoint "
                "directory (config.json + *.safetensors)"
            )
        if dtype is None:
            dtype = _default_dtype(ModelConfig.from_file(model).torch_dtype, device)
        return load_checkpoint(model, device=device, dtype=dtype)

    def _default_num_blocks(self, block_bytes: int) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return max(2, int(free * _GPU_CACHE_FRACTION) // block_bytes)
        return max(2, min(_CPU_DEFAULT_MAX_BLOCKS, _CPU_DEFAULT_CACHE_BYTES // block_bytes))

    # -- prompts -------------------------------------------------------------------------
    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, np.ndarray):
            return [prompts] if prompts.ndim == 1 else list(prompts)
        items: list[Any] = list(prompts)
        if items and all(isinstance(t, (int, np.integer)) for t in items):
            return [[int(t) for t in items]]
        return items

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError(
                    "text prompts need a tokenizer (tokenizer.json in the model directory); "
                    "pass token ids instead"
                )
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            ids = as_token_ids(prompt, "prompt token ids")
            text = None
        if not ids:
            raise InvalidArgumentError("a prompt must have at least one token")
        if len(ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"a prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                "(the prompt plus at least one generated token)"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return text, ids

    def _request_params(
        self, params: SamplingParams, prompt_len: int
    ) -> tuple[SamplingParams, int | None]:
        """A request's parameters as the scheduler runs them, and its EOS token.

        ``max_tokens`` is capped so that prompt + generated tokens stay within
        ``max_model_len`` (the scheduler then finishes the sequence there with
        ``"length"``); extra EOS ids of the model become stop tokens.
        """
        room = self.max_model_len - prompt_len
        if params.max_tokens > room:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        if not self.eos_token_ids or params.ignore_eos:
            return params, None
        extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
        if extra:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        return params, self.eos_token_ids[0]

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
            prompts: one prompt or a list (text and token-id prompts can be mixed).
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
        if stream:
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
        first record; the requests are queued when the iteration starts.
        """
        runs = self._prepare(prompts, sampling_params, priority)
        return self._run(runs)

    def abort(self, request_id: str) -> bool:
        """Abort a request of the running :meth:`stream` (``GenerationOutput.request_id``).

        Call it from the loop that consumes the stream: the request's last record, with
        ``finish_reason="abort"`` for its unfinished completions, is the stream's next
        record. Returns False for an unknown or already finished request.
        """
        run = self._runs.get(request_id)
        if run is None or run.finished:
            return False
        for i, (held, _fetch, _deadline) in enumerate(self._pending):
            if held is run:
                # Still waiting for its prefetch: the scheduler makes its abort record.
                del self._pending[i]
                self.scheduler.add_request(run.request)
                break
        record = self.scheduler.abort_request(request_id)
        if record is None:
            return False
        self._aborted.append(record)
        return True

    def _prepare(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None,
    ) -> list[RequestRun]:
        """Validate a call and build its requests (nothing is queued)."""
        items = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise InvalidArgumentError(
                    f"got {len(params_list)} SamplingParams for {len(items)} prompts"
                )
            for params in params_list:
                if not isinstance(params, SamplingParams):
                    raise InvalidArgumentError(
                        f"sampling_params must be SamplingParams, got {type(params).__name__}"
                    )
        priorities = _priorities(priority, len(items))
        encoded = [self._encode(p) for p in items]
        runs: list[RequestRun] = []
        for i, ((text, ids), params, prio) in enumerate(
            zip(encoded, params_list, priorities, strict=True)
        ):
            req_params, eos = self._request_params(params, len(ids))
            request = Request(
                request_id=str(self._next_request + i),
                prompt_token_ids=ids,
                sampling_params=req_params,
                eos_token_id=eos,
                priority=prio,
                retention_priority=params.retention_priority,
            )
            runs.append(RequestRun(request, params, text, i))
        self._next_request += len(runs)
        return runs

    def _run(self, runs: list[RequestRun]) -> Iterator[GenerationOutput]:
        """Queue ``runs`` and step until they finish, yielding each step's records."""
        if self._runs:
            raise InvalidArgumentError(
                "another generate()/stream() of this LLM is still running; finish or close it first"
            )
        self._runs = {run.request.request_id: run for run in runs}
        self._aborted = []
        self._mid_step = False
        start = time.perf_counter()
        steps = computed = 0
        try:
            self._queue_runs(runs)
            idle = 0
            while any(not run.finished for run in runs):
                for record in self._take_aborted():
                    yield from self._emit(record, {})
                self._admit_prefetched()
                if not self.scheduler.has_unfinished_requests():
                    break
                self._refetch_preempted()
                self._mid_step = True
                # logprobs=0 still wants the drawn token's log-prob: keep at least 1.
                self.runner.sampler.num_logprobs = max(
                    (
                        max(run.params.logprobs, 1)
                        for run in runs
                        if not run.finished and run.params.logprobs is not None
                    ),
                    default=0,
                )
                recomputes = self.scheduler.counters.num_preemptions_recompute
                out = self.scheduler.schedule()
                result = self.runner.execute(out)
                if self.remote is not None:
                    # The step's offloads are in the host pool; their slots stay pinned
                    # (keyed by their hashes) until update() confirms them.
                    self.remote.publish(out.memory_ops)
                step = self.scheduler.update(out, result)
                self._mid_step = False
                steps += 1
                computed += out.num_tokens
                moved = sum(len(pairs) for _kind, pairs in out.memory_ops)
                idle = idle + 1 if out.num_tokens == 0 and moved == 0 else 0
                if idle >= _MAX_IDLE_STEPS:
                    raise OutOfBlocksError(
                        f"the engine made no progress in {_MAX_IDLE_STEPS} steps: the KV "
                        f"cache ({self.manager.num_blocks} blocks, "
                        f"{self.manager.num_cpu_blocks} CPU blocks) cannot hold what the "
                        "waiting requests need"
                    )
                logprobs = self._step_logprobs(out, result)
                for record in step:
                    yield from self._emit(record, logprobs)
                if self.remote is not None and (
                    self.scheduler.counters.num_preemptions_recompute > recomputes
                ):
                    self._track_preempted()
            for record in self._take_aborted():
                yield from self._emit(record, {})
            missing = [r.request.request_id for r in runs if not r.finished]
            if missing:
                raise OutOfBlocksError(f"requests {missing} never finished")
        finally:
            # Whatever stopped the loop (an error, Ctrl-C, a consumer leaving the stream),
            # nothing of this call may stay queued: the next call must find an idle,
            # consistent engine.
            unfinished = [r.request.request_id for r in runs if not r.finished]
            self._pending.clear()
            self._readmit.clear()
            if unfinished or self._mid_step:
                self._abandon(unfinished)
            self._flush_tier_ops()
            self._runs = {}
            self._aborted = []
            self.runner.sampler.num_logprobs = 0
            elapsed = time.perf_counter() - start
            generated = sum(len(c.tokens) for r in runs for c in r.completions.values())
            self.run_stats = {
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

    def _queue_runs(self, runs: list[RequestRun]) -> None:
        """Queue a call's requests: straight to the scheduler without a remote tier, else
        behind a prefetch of their blocks from the store (see :meth:`_admit_prefetched`)."""
        if self.remote is None:
            for run in runs:
                self.scheduler.add_request(run.request)
            return
        wait = self.remote.options.fetch_wait_s
        for run in runs:
            request = run.request
            fetch = self.remote.prefetch(request.prompt_token_ids, request.retention_priority)
            self._pending.append((run, fetch, time.monotonic() + wait))

    def _admit_prefetched(self) -> None:
        """Hand held-back requests to the scheduler, in arrival order, once their read came
        back (its blocks are imported first) or its wait ran out (then they are computed).

        Between two steps only: imports confirm their slots. While other requests run, a
        read still under way holds its request (and those behind it) for a later step;
        with nothing else to run the engine waits for it, up to ``fetch_wait_s``.
        """
        remote = self.remote
        while self._pending and remote is not None:
            run, fetch, deadline = self._pending[0]
            if fetch is not None and not fetch.done():
                busy = self.scheduler.has_unfinished_requests()
                if not fetch.wait(0.0 if busy else deadline - time.monotonic()) and (
                    time.monotonic() < deadline
                ):
                    return
            if fetch is not None:
                remote.complete(fetch)
            self._pending.popleft()
            self.scheduler.add_request(run.request)

    def _track_preempted(self) -> None:
        """Note the sequences a step preempted by recompute (waiting to be re-admitted):
        each waiting completion's tokens, prompt + generated, which it recomputes.

        Requests that have generated nothing yet are left out: a prompt never admitted
        was read at arrival already, and one preempted mid-prefill is rare.
        """
        running = set(self.scheduler.running_request_ids())
        for rid, run in self._runs.items():
            if run.finished or rid in running:
                continue
            prompt = list(run.request.prompt_token_ids)
            for c in run.completions.values():
                key = (rid, c.index)
                if c.finish_reason is None and c.tokens and key not in self._readmit:
                    self._readmit[key] = (prompt + c.tokens, None)

    def _refetch_preempted(self) -> None:
        """Probe the remote store for preempted sequences that lost blocks locally.

        While a preempted sequence waits, other requests evict its blocks from the device
        pool and the host tier; they may be in the store (write-through put them there,
        or another instance did). Before each step, a sequence with more blocks missing
        locally than at its last probe is read again and its hits imported, so its
        re-admission loads them instead of recomputing them. The reads of one step run
        together, bounded by ``fetch_wait_s``; only steps where a waiting sequence lost
        blocks pay for it.
        """
        if self.remote is None or not self._readmit:
            return
        running = set(self.scheduler.running_request_ids())
        probe: list[tuple[tuple[str, int], list[int]]] = []
        for key, (tokens, seen) in list(self._readmit.items()):
            run = self._runs.get(key[0])
            if run is None or run.finished or key[0] in running:
                del self._readmit[key]  # re-admitted (or gone): nothing more to do
                continue
            missing = len(self.remote.missing(tokens))
            if missing and (seen is None or missing > seen):
                probe.append((key, tokens))
            self._readmit[key] = (tokens, missing)
        if probe:
            self.remote.refetch(
                [tokens for _, tokens in probe],
                [self._runs[key[0]].request.retention_priority for key, _ in probe],
            )
            for key, tokens in probe:
                self._readmit[key] = (tokens, len(self.remote.missing(tokens)))

    def _take_aborted(self) -> list[RequestOutput]:
        records, self._aborted = self._aborted, []
        return records

    def _step_logprobs(self, out: SchedulerOutput, result: ModelStepResult) -> StepLogprobs:
        """The drawn tokens' log-probs and top-N, for the requests that asked for them."""
        top = self.runner.sampler.last_top_logprobs
        if top is None or result.sampled_logprobs is None:
            return {}
        counts = np.asarray(out.sample_counts, dtype=np.int64)
        row_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        draw_no = np.arange(row_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
        seq_index = out.sample_seq_index
        base = np.zeros(len(counts), np.int64) if seq_index is None else np.asarray(seq_index)
        index = (base[row_of] + draw_no).tolist()
        drawn = np.asarray(result.sampled_logprobs, dtype=np.float64).tolist()
        wanted = {rid for rid, run in self._runs.items() if run.params.logprobs is not None}
        request_ids = out.sample_request_ids
        found: StepLogprobs = {}
        for j, row in enumerate(row_of.tolist()):  # opt-in: only when logprobs are asked
            rid = request_ids[row]
            if rid in wanted:
                found[rid, index[j]] = (drawn[j], top[0][j], top[1][j])
        return found

    def _emit(
        self,
        record: RequestOutput,
        logprobs: dict[tuple[str, int], tuple[float, np.ndarray, np.ndarray]],
    ) -> Iterator[GenerationOutput]:
        """Turn one scheduler record into the stream's record (if anything changed)."""
        run = self._runs.get(record.request_id)
        if run is None or run.finished:
            return
        changed = run.absorb(record, logprobs, self.tokenizer)
        for index in run.take_stopped():
            # One sample of several matched a stop string: free it now if the
            # scheduler can (else its further tokens are ignored).
            self.scheduler.finish_sequence(record.request_id, index, FinishReason.STOP)
        if run.stopped_all() and not record.finished:
            # Every completion matched a stop string: the scheduler can let it go.
            aborted = self.scheduler.abort_request(record.request_id, FinishReason.STOP)
            if aborted is not None:
                run.absorb(aborted, {}, self.tokenizer, new_step=False)
            run.finished = True
            changed = True
        if record.finished:
            run.finished = True
        if changed:
            yield run.output()

    def _abandon(self, request_ids: list[str]) -> None:
        """Withdraw a failed call's requests and leave the engine ready for the next one.

        Between ``schedule()`` and ``update()`` (``self._mid_step``) the scheduler cannot
        take another step, and the KV memory may not hold what the manager's tables say
        (a forward pass or a swap-in cut short). Then every sequence is freed, the prefix
        cache is dropped (its blocks may hold unfinished KV) and a fresh scheduler,
        carrying on the counters, takes over.
        """
        for rid in request_ids:
            self.scheduler.abort_request(rid)
        self.runner.sampler.forget(request_ids)
        if not self._mid_step:
            return
        old = self.scheduler
        for seq in self.manager.seq_ids().tolist():
            self.manager.free(int(seq))
        # Block moves for sequences that no longer exist: drained and confirmed so that
        # host-tier slots unpin; reset_prefix_cache then drops every unpinned slot,
        # including those whose offload never ran.
        self.manager.take_memory_ops()
        self.manager.confirm_memory_ops()
        self.manager.reset_prefix_cache()
        self.scheduler = Scheduler(
            self.manager, self._scheduler_config, event_publisher=self._event_publisher
        )
        self.scheduler.counters = old.counters
        self.scheduler.stats_history = old.stats_history
        self._mid_step = False

    def _flush_tier_ops(self) -> None:
        """Apply the host-tier ops queued since the last step, between two calls.

        The last step's ``update()`` can queue offloads (write-through commits); the next
        step would carry them, but between calls the tier should hold what it claims and
        no slot stay pinned. If applying them fails, nothing they named is trusted: the
        prefix cache and the tier's unpinned slots are dropped.
        """
        if self._mid_step:
            return
        memory_ops = self.manager.take_memory_ops()
        if not memory_ops:
            return
        try:
            self.runner.apply_block_ops(memory_ops)
        except BaseException:
            self.manager.confirm_memory_ops()
            self.manager.reset_prefix_cache()
            raise
        if self.remote is not None:
            self.remote.publish(memory_ops)
        self.manager.confirm_memory_ops()

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
            "engine": dict(self.run_stats),
            "scheduler": self.scheduler.stats(),
            "cache": dict(self.manager.stats()),
        }
        if self.remote is not None:
            stats["remote"] = {**vars(self.remote.stats), **vars(self.remote.store.stats())}
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


def _priorities(priority: int | Sequence[int] | None, count: int) -> list[int]:
    """One priority per prompt (default 0)."""
    if priority is None:
        return [0] * count
    if isinstance(priority, (int, np.integer)) and not isinstance(priority, bool):
        return [int(priority)] * count
    if isinstance(priority, (str, bytes)):
        raise InvalidArgumentError(f"priority must be an int or a list of ints, got {priority!r}")
    try:
        values = list(priority)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"priority must be an int or a list of ints, got {priority!r}"
        ) from None
    if len(values) != count:
        raise InvalidArgumentError(f"got {len(values)} priorities for {count} prompts")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"priorities must be ints, got {v!r}")
    return [int(v) for v in values]


def _check_max_model_len(value: int | None, model_limit: int) -> int:
    """``max_model_len`` validated against the model's position limit (default: the limit)."""
    if value is None:
        return model_limit
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise InvalidArgumentError(f"max_model_len must be an int >= 2, got {value!r}")
    if value > model_limit:
        raise InvalidArgumentError(
            f"max_model_len={value} exceeds the model's max_position_embeddings ({model_limit})"
        )
    return value
