"""Applying a step's results (:class:`ResultApplier`) and ``min_tokens``.

Decoding sequences take their token with a few vectorised operations on the decode table
(append, stop conditions); Python runs per request only on events: a prompt that
completes (its first token, the ``n > 1`` fork), a sequence that finishes, a beam step.
``min_tokens`` works on both sides of the step: before it, rows of sequences that may
not stop yet ban their stop tokens (:meth:`ResultApplier.suppress_early_stops`); after
it, no stop condition fires before ``min_tokens`` tokens
(:meth:`RequestState.finish_reason_for`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.protocols import BlockManager
from kvblocks.scheduler.batch import StepPlan
from kvblocks.scheduler.beam_search import BeamSearch
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.scheduler.placement import Placement
from kvblocks.scheduler.records import Records
from kvblocks.scheduler.request import CompletionOutput, FinishReason
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.stats import SchedulerCounters
from kvblocks.scheduler.step import UpdateState
from kvblocks.scheduler.step_outputs import DecodeDeltas
from kvblocks.validation import TOKEN_ID_MAX, check_int_array, check_real_array

__all__ = ["ResultApplier", "check_result"]

Rows = npt.NDArray[np.int64] | slice
"""Decode-table rows: an index array, or ``slice(0, n)`` when the step's decode rows are
still the table's first ``n`` rows (no reordering since they were cut)."""


def check_result(
    output: SchedulerOutput, plan: StepPlan, result: ModelStepResult
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """The sampled tokens and their log-probs as flat arrays, checked against the step.

    Raises:
        InvalidArgumentError: ``result`` does not match ``output`` (token counts,
            missing top-K for beam rows).
    """
    if not isinstance(result, ModelStepResult):
        raise InvalidTypeError(f"update() takes a ModelStepResult, got {type(result).__name__}")
    counts = output.sample_counts
    # No dtype= in asarray: that cast would truncate floats, parse strings and wrap
    # unsigned values; -1 is the decode table's "no token", so a negative one would
    # silently drop the step's KV.
    sampled = result.sampled_token_ids
    # An engine's int64 array (every step's case) is range-checked in one reduction.
    if not (
        type(sampled) is np.ndarray
        and sampled.dtype == np.int64
        and (not sampled.size or int(sampled.view(np.uint64).max()) <= TOKEN_ID_MAX)
    ):
        sampled = _as_array(sampled, "sampled_token_ids")
        check_int_array(sampled, "sampled_token_ids", minimum=0, maximum=TOKEN_ID_MAX)
        sampled = sampled.astype(np.int64, copy=False)
    if sampled.ndim != 1:
        sampled = sampled.reshape(-1)
    total = int(counts.sum()) if plan.special else len(counts)
    if sampled.shape[0] != total:
        raise InvalidArgumentError(
            f"sampled_token_ids has {sampled.shape[0]} tokens, the step's sample_counts "
            f"sum to {total}"
        )
    if result.sampled_logprobs is None:
        logprobs = np.zeros(total, dtype=np.float64)
    else:
        raw: Any = result.sampled_logprobs
        if not (type(raw) is np.ndarray and raw.dtype.kind == "f"):
            raw = _as_array(raw, "sampled_logprobs")
            check_real_array(raw, "sampled_logprobs")
        logprobs = raw.astype(np.float64, copy=False)
        if logprobs.ndim != 1:
            logprobs = logprobs.reshape(-1)
        if logprobs.shape[0] != total:
            raise InvalidArgumentError(
                f"sampled_logprobs has {logprobs.shape[0]} entries, expected {total}"
            )
    if output.beam_topk:
        _check_top_k(result, len(counts), output.beam_topk)
    return sampled, logprobs


def _as_array(value: object, name: str) -> npt.NDArray[Any]:
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged nesting
        raise InvalidArgumentError(f"{name} must be an array: {exc}") from exc


def _check_top_k(result: ModelStepResult, rows: int, k: int) -> None:
    """Raise unless the result's top-K arrays are ``[R, K']`` (``1 <= K' <= K``: the
    engine's sampler returns ``min(K, vocab)`` columns) of token ids and log-probs."""
    if result.topk_token_ids is None or result.topk_logprobs is None:
        raise InvalidArgumentError(
            f"this step has beam-search rows: topk_token_ids/topk_logprobs [R, {k}] are required"
        )
    ids = _as_array(result.topk_token_ids, "topk_token_ids")
    lps = _as_array(result.topk_logprobs, "topk_logprobs")
    if (
        ids.ndim != 2
        or ids.shape[0] != rows
        or not 1 <= ids.shape[1] <= k
        or lps.shape != ids.shape
    ):
        raise InvalidArgumentError(
            f"topk_token_ids {list(ids.shape)} and topk_logprobs {list(lps.shape)} must both "
            f"be [R={rows}, K] with K in [1, {k}] columns"
        )
    check_int_array(ids, "topk_token_ids", minimum=0, maximum=TOKEN_ID_MAX)
    check_real_array(lps, "topk_logprobs")


class ResultApplier:
    """Appends a step's sampled tokens, applies stop conditions and forks."""

    def __init__(
        self,
        manager: BlockManager,
        placement: Placement,
        records: Records,
        beams: BeamSearch,
        counters: SchedulerCounters,
    ) -> None:
        self.manager = manager
        self.placement = placement
        self.records = records
        self.beams = beams
        self.counters = counters

    def apply(
        self,
        output: SchedulerOutput,
        plan: StepPlan,
        sampled: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        result: ModelStepResult,
        upd: UpdateState,
    ) -> DecodeDeltas | None:
        """Apply the results of a step that computed something; return the decode
        rows' tokens as columns."""
        table = self.placement.table
        decode: DecodeDeltas | None = None
        counts = output.sample_counts
        num_decode = output.num_decode_seqs
        if plan.special:
            offsets = np.cumsum(counts, dtype=np.int64) - counts
            ones = counts == 1
            safe = np.minimum(offsets, max(len(sampled) - 1, 0))
            row_tok = np.where(ones, sampled[safe] if len(sampled) else -1, -1)
            row_lp = np.where(ones, logprobs[safe] if len(sampled) else 0.0, 0.0)
        else:
            offsets = None
            ones = None
            row_tok = sampled
            row_lp = logprobs
        if len(row_tok) == output.num_seqs:
            commit_tokens = row_tok  # every sequence samples: rows are the batch order
        else:
            commit_tokens = np.full(output.num_seqs, -1, dtype=np.int64)
            commit_tokens[plan.row_seq_pos] = row_tok
        # Decodes only: one computed token each.
        computed = 1 if not plan.chunks else output.num_scheduled_tokens
        self.manager.commit_batch(output.seq_ids, computed, commit_tokens)
        # Every drawn token: one per ordinary row, n for a prompt row that forks n samples
        # (beam tokens are counted in BeamSearch.step).
        self.counters.num_generated_tokens += int(counts.sum()) if plan.special else len(row_tok)

        # Decodes: vectorised append of one token per sequence, then stop conditions.
        if num_decode:
            rows: Rows = slice(0, num_decode)
            if plan.table_version != table.version or ones is not None:
                rows = table.rows_of(output.seq_ids[:num_decode])
            tok = row_tok[:num_decode]
            lp = row_lp[:num_decode]
            beam_rows = None
            if ones is not None:
                assert not isinstance(rows, slice)
                mask = ones[:num_decode]
                beam_rows = rows[~mask]
                rows, tok, lp = rows[mask], tok[mask], lp[mask]
            cols = table.cols
            cols["last_token"][rows] = tok
            if isinstance(rows, slice):
                # Views of the columns: add in place (no gather and scatter back).
                num_tokens, cum = cols["num_tokens"][rows], cols["cum_logprob"][rows]
                num_tokens += 1
                cum += lp
                generated = cols["num_generated"][rows]
                generated += 1
                generated = generated.copy()
            else:
                cols["num_tokens"][rows] += 1
                generated = cols["num_generated"][rows] + 1
                cols["num_generated"][rows] = generated
                cols["cum_logprob"][rows] += lp
            decode = self._decode_deltas(rows, tok, generated, plan.aborted)
            done = generated >= cols["max_tokens"][rows]
            done |= tok == cols["eos"][rows]
            stop_tokens = self.placement.registry.stop_tokens
            if stop_tokens.size:
                done |= cols["has_stop"][rows] & np.isin(tok, stop_tokens)
            if np.count_nonzero(done):  # cheaper than done.any() at this size
                hits = np.flatnonzero(done)
                ended = hits if isinstance(rows, slice) else rows[hits]
                self._finish_decode_rows(ended, tok[hits], upd)
            if beam_rows is not None and beam_rows.size:
                self.beams.decode(beam_rows, output, result, upd)
        if plan.chunks:
            self._apply_chunks(plan, sampled, logprobs, row_tok, row_lp, offsets, result, upd)
        if upd.remove_rows or upd.add_rows:
            remove = np.concatenate(upd.remove_rows) if upd.remove_rows else None
            table.update(remove, upd.add_rows)
        return decode

    def _apply_chunks(
        self,
        plan: StepPlan,
        sampled: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        row_tok: npt.NDArray[np.int64],
        row_lp: npt.NDArray[np.float64],
        offsets: npt.NDArray[np.int64] | None,
        result: ModelStepResult,
        upd: UpdateState,
    ) -> None:
        """Prefill chunks: progress, and the first token(s) of completed prompts."""
        output = plan.output
        counts = output.sample_counts
        num_decode = output.num_decode_seqs
        sample_row_of_chunk = {j: num_decode + i for i, j in enumerate(plan.row_chunk)}
        for j, (state, _start, length) in enumerate(plan.chunks):
            if state.aborted or state.status is not RequestStatus.PREFILL:
                continue
            state.num_computed += length
            row = sample_row_of_chunk.get(j)
            if row is None:
                continue
            self.placement.prefilling.remove(state)
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = upd.now
            if state.params.use_beam_search:
                assert result.topk_token_ids is not None and result.topk_logprobs is not None
                state.status = RequestStatus.RUNNING
                self.beams.step(
                    state,
                    [state.seq_ids[0]],
                    np.array([state.cum_logprob]),
                    len(state.tokens),
                    len(state.tokens) - state.num_prompt,
                    np.asarray(result.topk_token_ids)[row : row + 1],
                    np.asarray(result.topk_logprobs)[row : row + 1],
                    upd,
                )
            elif counts[row] > 1:
                assert offsets is not None
                first = int(offsets[row])
                toks = sampled[first : first + int(counts[row])]
                lps = logprobs[first : first + int(counts[row])]
                self._fork_samples(state, toks, lps, upd)
            else:
                self._start_decoding(
                    state, [state.seq_ids[0]], row_tok[row : row + 1], row_lp[row : row + 1], upd
                )

    def suppress_early_stops(self, output: SchedulerOutput) -> None:
        """``min_tokens``: ban EOS and the stop tokens in the rows of sequences that have
        generated fewer than ``min_tokens`` tokens (vLLM's rule: they may end the sequence
        from token ``min_tokens + 1`` on), through ``output.suppressed_*``."""
        mgr = self.manager
        owner = self.placement.registry.owner
        banned: list[list[int]] = []
        for seq in output.sample_seq_ids.tolist():
            state = owner.get(seq)
            if (
                state is None
                or not state.params.min_tokens
                or mgr.num_tokens(seq) - state.num_prompt >= state.params.min_tokens
            ):
                banned.append([])
                continue
            banned.append(sorted(state.beam_stops))  # the stop tokens and EOS
        counts = [len(b) for b in banned]
        if not any(counts):
            return
        indptr = np.zeros(len(banned) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        output.suppressed_indptr = indptr
        output.suppressed_token_ids = np.array([t for b in banned for t in b], dtype=np.int64)

    def _decode_deltas(
        self,
        rows: Rows,
        tokens: npt.NDArray[np.int64],
        generated: npt.NDArray[np.int64],
        aborted: list[RequestState],
    ) -> DecodeDeltas:
        """The decode rows' new tokens as columns (rows of aborted requests left out)."""
        cols = self.placement.table.cols
        if aborted:
            if isinstance(rows, slice):
                rows = np.arange(rows.start, rows.stop, dtype=np.int64)
            seqs = [s for a in aborted for p in (a, *a.parts) for s in p.seq_ids]
            keep = ~np.isin(cols["seq_id"][rows], np.array(seqs, dtype=np.int64))
            rows, tokens, generated = rows[keep], tokens[keep], generated[keep]
        cums = cols["cum_logprob"][rows]
        if isinstance(rows, slice):
            cums = cums.copy()  # a view of what the next step updates in place
        # generated is a fresh array; tokens may be a view of the engine's result.
        return DecodeDeltas(
            rows,
            cols["request_id"],
            cols["seq_index"],
            np.array(tokens, dtype=np.int64),
            cums,
            generated,
        )

    def _finish_decode_rows(
        self, rows: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], upd: UpdateState
    ) -> None:
        cols = self.placement.table.cols
        owner = self.placement.registry.owner
        seq_ids = cols["seq_id"][rows].tolist()
        cums = cols["cum_logprob"][rows].tolist()
        kept: list[int] = []
        for row, seq, tok, cum in zip(rows.tolist(), seq_ids, tokens.tolist(), cums, strict=True):
            state = owner[seq]
            if state.aborted:
                continue
            generated = int(cols["num_generated"][row])
            reason = state.finish_reason_for(tok, generated)
            if reason is None:
                if generated < state.params.max_tokens:
                    continue  # a stop token of another request
                reason = FinishReason.LENGTH
            kept.append(row)
            out = self.records.finish_seq(state, seq, reason, cum, upd)
            if out is not None:
                upd.finished.append(out)
        if kept:
            upd.remove_rows.append(np.array(kept, dtype=np.int64))

    def _start_decoding(
        self,
        state: RequestState,
        seq_ids: list[int],
        tokens: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        upd: UpdateState,
    ) -> None:
        """Sequences whose prompt is computed and that just got their first new token."""
        state.status = RequestStatus.RUNNING
        num_tokens = len(state.tokens) + 1
        generated = num_tokens - state.num_prompt
        cum = state.cum_logprob + logprobs
        keep: list[int] = []
        events = upd.events.setdefault(state.request.request_id, {})
        for i, (seq, tok) in enumerate(zip(seq_ids, tokens.tolist(), strict=True)):
            reason = state.finish_reason_for(tok, generated)
            if reason is None and generated >= state.params.max_tokens:
                reason = FinishReason.LENGTH
            if reason is None:
                keep.append(i)
                index = state.seq_index[seq]
                events[index] = CompletionOutput(index, [], float(cum[i]), None, [tok], generated)
                continue
            out = self.records.finish_seq(state, seq, reason, float(cum[i]), upd)
            if out is not None:
                upd.finished.append(out)
        if keep:
            idx = np.array(keep, dtype=np.int64)
            upd.add_rows.append(
                state.table_rows(
                    np.array(seq_ids, dtype=np.int64)[idx],
                    tokens[idx],
                    num_tokens,
                    generated,
                    cum[idx],
                )
            )

    def _fork_samples(
        self,
        state: RequestState,
        tokens: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        upd: UpdateState,
    ) -> None:
        """``n > 1``: fork the prompt's sequence once per extra sample (shared KV, CoW)."""
        registry = self.placement.registry
        parent = state.seq_ids[0]
        seq_ids = [parent]
        for index in range(1, len(tokens)):
            child = registry.new_seq_id()
            self.manager.fork(parent, child)
            registry.adopt(state, child, index)
            seq_ids.append(child)
        state.seq_ids = list(seq_ids)  # _start_decoding may drop finished ones from it
        state.multi = True
        self.manager.commit_batch(np.array(seq_ids, dtype=np.int64), 0, tokens)
        self._start_decoding(state, seq_ids, tokens, logprobs, upd)
