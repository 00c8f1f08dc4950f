"""``kvblocks generate``: run the paged engine on a model and print what it generates.

Wired into the ``kvblocks`` command by :mod:`kvblocks.cli` through :func:`add_parser`
and :func:`run`; torch and the engine are imported only when the subcommand runs, so
``kvblocks --help`` and the other subcommands stay fast and work without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

from kvblocks.cli.arg_types import (
    non_negative_int,
    option_flags,
    positive_int,
    thread_count,
    token_ids,
)
from kvblocks.errors import InvalidArgumentError

__all__ = ["add_parser", "format_table", "run"]

DEFAULT_TEXT_PROMPT = "Paged attention keeps the KV cache in blocks"
"""Prompt used when none is given and the model has a tokenizer."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="generate text with the paged-attention engine (tiny built-in model by default)",
        description=(
            "Run the kvblocks engine (scheduler + block manager + paged attention) on the "
            "built-in tiny model or a Hugging Face checkpoint directory of a supported "
            "family (Llama, Mistral, Ministral, Qwen2, Qwen3, OLMo 3, Gemma 2, Gemma 3, "
            "gpt-oss, Llama 4 (text), Bamba; config.json + *.safetensors), print the generated "
            "tokens as they are produced, then the completions and the engine, scheduler and "
            "cache statistics."
        ),
    )
    src = p.add_argument_group("model and prompts")
    src.add_argument(
        "--model",
        metavar="PATH",
        help="HF checkpoint directory (default: the built-in tiny model, byte tokenizer)",
    )
    src.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (needs a tokenizer); repeat for a batch",
    )
    src.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        type=token_ids,
        metavar="IDS",
        help="a prompt as comma-separated token ids, e.g. 1,2,3; repeat for a batch",
    )
    samp = p.add_argument_group("sampling")
    samp.add_argument("--max-tokens", type=positive_int, default=16, help="default: 16")
    samp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    samp.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1)")
    samp.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off (default)")
    samp.add_argument("--seed", type=non_negative_int, default=None, help="per-request seed")
    samp.add_argument("--n", type=positive_int, default=1, help="completions per prompt")
    samp.add_argument("--beam-width", type=positive_int, default=1, help="> 1 turns on beam search")
    samp.add_argument(
        "--stop-token-ids", type=token_ids, default=[], metavar="IDS", help="e.g. 2,13"
    )
    samp.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    samp.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop string (the text is cut before it); repeat for several",
    )
    samp.add_argument(
        "--min-tokens", type=non_negative_int, default=0, help="no EOS/stop before this many"
    )
    samp.add_argument(
        "--logprobs", type=non_negative_int, default=None, metavar="N", help="top-N per token"
    )
    eng = p.add_argument_group("engine")
    eng.add_argument("--num-blocks", type=positive_int, default=None, help="KV cache blocks")
    eng.add_argument("--block-size", type=int, choices=(8, 16, 32), default=16)
    eng.add_argument("--num-cpu-blocks", type=non_negative_int, default=None)
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument(
        "--host-cache-blocks",
        type=non_negative_int,
        default=0,
        help="slots of a host-memory tier below the KV cache: evicted prefix blocks are "
        "kept there and loaded back on a hit (default: 0, no tier; needs prefix caching)",
    )
    eng.add_argument(
        "--host-offload",
        choices=("evict", "commit"),
        default=None,
        help="when a block is copied to the host tier: evict (when its KV cache block is "
        "reused) or commit (write-through, every computed block; default with a remote "
        "tier, which is written what the host tier is; otherwise evict)",
    )
    eng.add_argument(
        "--no-kv-cache-groups",
        action="store_true",
        help="a model mixing sliding-window or chunked and full-attention layers (Gemma 2/3, "
        "gpt-oss, Llama 4, ...) keeps one full-attention KV cache group of every layer, each "
        "window layer masking its window (default: one group per attention kind, whose blocks "
        "that slid out of the window or past chunks go back to the pool)",
    )
    eng.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    eng.add_argument("--max-num-seqs", type=positive_int, default=256)
    eng.add_argument("--preemption-mode", choices=("recompute", "swap"), default=None)
    eng.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="most tokens per sequence, prompt included (default: the model's "
        "max_position_embeddings)",
    )
    eng.add_argument("--device", default=None, help="cpu or cuda (default: cuda if usable)")
    eng.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None)
    eng.add_argument(
        "--engine-seed", type=non_negative_int, default=0, help="engine generator seed"
    )
    eng.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="torch CPU threads, 1..1024 (default: 1 for the tiny model, whose ops are too "
        "small to split, torch's default for a checkpoint)",
    )
    tier = p.add_argument_group(
        "remote tier",
        "A store below the host tier (needs --host-cache-blocks), shared by every engine "
        "that uses it with the same weights: each block offloaded to the host tier is also "
        "written there, and a prompt's blocks past this engine's own prefix hit are read "
        "from it and loaded instead of computed. An unreachable server reads as misses (one "
        "warning line on stderr) and a damaged value as a miss: the blocks are computed and "
        "the run succeeds.",
    )
    where = tier.add_mutually_exclusive_group()
    where.add_argument(
        "--valkey-url",
        metavar="URL",
        help="a Valkey or Redis server, e.g. valkey://127.0.0.1:6379/0 (pip install "
        "'kvblocks[tiers]'); its maxmemory bounds the tier",
    )
    where.add_argument(
        "--disk-tier",
        metavar="DIR",
        help="a directory of block files; it survives restarts, so the next run on it "
        "loads what this one computed",
    )
    tier.add_argument(
        "--disk-tier-blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="blocks the --disk-tier directory holds at most, least recently used evicted "
        "first (default: 65536)",
    )
    tier.add_argument(
        "--model-id",
        metavar="ID",
        default=None,
        help="an addition to the weights' identity in the remote tier: engines share "
        "blocks only when their weights (config and every tensor, hashed once per "
        "checkpoint and cached in $KVBLOCKS_WEIGHTS_CACHE) and this id both agree "
        "(default: none, the weights alone)",
    )
    tier.add_argument(
        "--trust-model-id",
        action="store_true",
        help="the opt-out, by name: leave the weights' digest out and name the weights by "
        "--model-id alone, for checkpoints you know are identical but hash differently "
        "(re-saved, converted); a wrong id then gives wrong tokens without an error",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument(
        "--no-stream", action="store_true", help="print only the final outputs, not each step"
    )
    p.set_defaults(run=run, flags=option_flags(p))
    return p


def _remote_tier(args: argparse.Namespace, opened: list[Any]) -> Callable[[Any], Any] | None:
    """The engine's ``remote_tier`` factory for ``--valkey-url`` / ``--disk-tier`` (None
    without either); each store it opens is appended to ``opened`` (the caller closes it).

    Raises:
        InvalidArgumentError: no host tier below which to put it, a tier option
            (``--disk-tier-blocks``, ``--model-id``, ``--trust-model-id``) without its tier,
            or ``--trust-model-id`` without ``--model-id``.
    """
    if args.valkey_url is None and args.disk_tier is None:
        for flag, value in (
            ("--disk-tier-blocks", args.disk_tier_blocks),
            ("--model-id", args.model_id),
            ("--trust-model-id", args.trust_model_id or None),
        ):
            if value is not None:
                raise InvalidArgumentError(f"{flag} needs --disk-tier or --valkey-url")
        return None
    if args.trust_model_id and not args.model_id:
        raise InvalidArgumentError("--trust-model-id needs --model-id (the name it trusts)")
    if args.disk_tier_blocks is not None and args.disk_tier is None:
        raise InvalidArgumentError("--disk-tier-blocks needs --disk-tier")
    option = "--valkey-url" if args.valkey_url is not None else "--disk-tier"
    if args.host_cache_blocks == 0:
        raise InvalidArgumentError(
            f"{option} needs a host tier to load into (--host-cache-blocks N, N > 0)"
        )
    model_id = args.model_id or ""

    def build(layout: Any) -> Any:
        # The engine's layout carries its weights' digest; the id is added to it.
        layout = dataclasses.replace(
            layout, model_id=model_id, trust_model_id=bool(args.trust_model_id)
        )
        try:
            if args.valkey_url is not None:
                from kvblocks.tiers.valkey_tier import ValkeyTier

                store: Any = ValkeyTier(layout, url=args.valkey_url)
            else:
                from kvblocks.tiers.disk import DiskTier

                store = DiskTier(args.disk_tier, layout, args.disk_tier_blocks or 65536)
        except (ValueError, OSError) as exc:  # a bad URL, an unusable directory
            value = args.valkey_url if args.valkey_url is not None else args.disk_tier
            raise InvalidArgumentError(f"{option} {value!r}: {exc}") from exc
        opened.append(store)
        return store

    return build


def _build(args: argparse.Namespace, opened: list[Any]) -> tuple[Any, list[Any], Any]:
    # The tier options are checked before torch is imported (seconds): a mistyped option
    # is reported at once.
    remote = _remote_tier(args, opened)

    import torch

    from kvblocks.engine import LLM
    from kvblocks.sampling_params import SamplingParams

    threads = args.threads or (1 if args.model is None else None)
    if threads:
        torch.set_num_threads(threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
        beam_width=args.beam_width,
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
        min_tokens=args.min_tokens,
        logprobs=args.logprobs,
    )
    llm = LLM(
        args.model,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_cpu_blocks=args.num_cpu_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_groups=not args.no_kv_cache_groups,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        preemption_mode=args.preemption_mode,
        device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        seed=args.engine_seed,
        max_model_len=args.max_model_len,
        host_cache_blocks=args.host_cache_blocks,
        host_offload=args.host_offload or ("commit" if remote is not None else "evict"),
        remote_tier=remote,
    )
    prompts: list[Any] = list(args.prompt) + list(args.prompt_ids)
    if not prompts:
        prompts = [DEFAULT_TEXT_PROMPT] if llm.tokenizer is not None else [[1, 2, 3, 4]]
    return llm, prompts, params


def _stream(llm: Any, prompts: list[Any], params: Any) -> list[Any]:
    """Generate, printing each step's new tokens as they come; the final outputs in order.

    One completion in all: its text (or token ids) is written inline as it grows. Several:
    one line per request and step, ``p<prompt>[<index>] +<new tokens> <new text>``.
    """
    single = len(prompts) == 1 and params.n == 1 and params.beam_width == 1
    final: dict[int, Any] = {}
    out = sys.stdout
    if single:
        out.write("streaming: ")
    for record in llm.stream(prompts, params):
        for c in record.outputs:
            if not c.new_token_ids and not c.new_text:
                continue
            if single:
                if c.new_text is not None:
                    out.write(_printable(c.new_text))
                else:
                    out.write("".join(f"{t} " for t in c.new_token_ids))
            else:
                text = f" {c.new_text!r}" if c.new_text is not None else ""
                out.write(f"  p{record.prompt_index}[{c.index}] +{c.new_token_ids}{text}\n")
            out.flush()
        if record.finished:
            final[record.prompt_index] = record
    if single:
        out.write("\n")
    return [final[i] for i in range(len(prompts))]


def _printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def _report(llm: Any, outputs: list[Any], as_json: bool) -> None:
    stats = llm.stats()
    if as_json:
        doc = {
            "outputs": [
                {
                    "prompt": o.prompt,
                    "prompt_token_ids": o.prompt_token_ids,
                    "num_cached_tokens": o.num_cached_tokens,
                    "completions": [
                        {
                            "index": c.index,
                            "token_ids": c.token_ids,
                            "text": c.text,
                            "cumulative_logprob": c.cumulative_logprob,
                            "finish_reason": str(c.finish_reason),
                            "stop_reason": c.stop_reason,
                            "logprobs": None
                            if c.logprobs is None
                            else [dataclasses.asdict(e) for e in c.logprobs],
                        }
                        for c in o.outputs
                    ],
                }
                for o in outputs
            ],
            "stats": stats,
            "kv_cache_groups": llm.manager.num_groups,
        }
        print(json.dumps(doc, indent=2, default=float))
        return
    for i, o in enumerate(outputs):
        shown = repr(o.prompt) if o.prompt is not None else o.prompt_token_ids
        print(
            f"prompt {i}: {shown} ({len(o.prompt_token_ids)} tokens, "
            f"{o.num_cached_tokens} from the prefix cache)"
        )
        for c in o.outputs:
            stop = f" stop={c.stop_reason!r}" if c.stop_reason is not None else ""
            print(
                f"  [{c.index}] finish={c.finish_reason}{stop} "
                f"logprob={c.cumulative_logprob:.3f} tokens={c.token_ids}"
            )
            if c.text is not None:
                print(f"      text={c.text!r}")
            if c.logprobs:
                top = " ".join(f"{e.token_id}:{e.logprob:.3f}" for e in c.logprobs)
                print(f"      logprobs={top}")
    eng = stats["engine"]
    print(
        f"engine: {int(eng['steps'])} steps, {int(eng['computed_tokens'])} tokens computed, "
        f"{int(eng['generated_tokens'])} generated in {eng['elapsed_s']:.3f} s "
        f"({eng['generated_tokens_per_s']:.1f} tokens/s) on {llm.device} {llm.dtype}, "
        f"{llm.manager.num_groups} KV cache group(s)"
    )
    for section in ("scheduler", "cache", "remote"):
        if section in stats:
            print(f"{section}:")
            print(format_table(stats[section]))


def format_table(values: dict[str, Any], columns: int = 2) -> str:
    """``name value`` pairs as an aligned table, ``columns`` pairs per line, in name order.

    Integers print as integers, other numbers with four significant digits.
    """
    items = [(k, _fmt(v)) for k, v in sorted(values.items())]
    if not items:
        return "  (none)"
    key_w = max(len(k) for k, _ in items)
    val_w = max(len(v) for _, v in items)
    rows = (len(items) + columns - 1) // columns
    lines = []
    for r in range(rows):
        cells = [items[c * rows + r] for c in range(columns) if c * rows + r < len(items)]
        lines.append("  " + "    ".join(f"{k:<{key_w}}  {v:>{val_w}}" for k, v in cells).rstrip())
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run(args: argparse.Namespace) -> int:
    """Execute ``kvblocks generate``; return the process exit status.

    A :class:`~kvblocks.errors.KVBlocksError` propagates to :func:`kvblocks.cli.main`,
    which prints it as one line; a missing engine dependency is reported here. Warnings
    raised or logged during the run (an unreachable remote tier, ...) print as one line each.
    """
    opened: list[Any] = []
    handler = _OneLineLogHandler(logging.WARNING)
    package_logger = logging.getLogger("kvblocks")
    package_logger.addHandler(handler)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _one_line_warning
        try:
            try:
                llm, prompts, params = _build(args, opened)
            except ImportError as exc:
                tiers = exc.name == "valkey"
                print(
                    f"kvblocks generate: error: {'--valkey-url' if tiers else 'the engine'} "
                    f"needs {exc.name or 'torch'} "
                    f"(pip install 'kvblocks[{'tiers' if tiers else 'engine'}]')",
                    file=sys.stderr,
                )
                return 1
            with llm:
                if args.json or args.no_stream:
                    outputs = llm.generate(prompts, params)
                else:
                    outputs = _stream(llm, prompts, params)
            _report(llm, outputs, args.json)
        finally:
            for store in opened:
                store.close()
            package_logger.removeHandler(handler)
    return 0


class _OneLineLogHandler(logging.Handler):
    """Prints the package's logged operational faults (``kvblocks.tiers``, ...) as
    ``kvblocks generate: warning: ...``, like the warnings."""

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(self.format(record).split())
        print(f"kvblocks generate: {record.levelname.lower()}: {text}", file=sys.stderr, flush=True)


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` for the command line: ``kvblocks generate: warning: ...``."""
    text = " ".join(str(message).split())
    print(f"kvblocks generate: warning: {text}", file=sys.stderr, flush=True)
