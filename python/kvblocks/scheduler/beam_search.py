"""Beam search in the scheduler (:class:`BeamSearch`): one step of a request's beams.

The candidates come from :func:`~kvblocks.scheduler.beam.select_beams`; this module
applies them to the block manager: a parent chosen by several beams is forked (the
shared KV stays one copy, copy-on-write), a parent chosen by none is freed, and every
beam's token is committed. Beam rows leave the decode table each step and come back as
the new beams' rows.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import numpy.typing as npt

from kvblocks.protocols import BlockManager
from kvblocks.scheduler.beam import Hypothesis, select_beams
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.scheduler.placement import Placement
from kvblocks.scheduler.records import Records
from kvblocks.scheduler.request import FinishReason
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.stats import SchedulerCounters
from kvblocks.scheduler.step import UpdateState

__all__ = ["BeamSearch"]


class BeamSearch:
    """Applies a step's top-K results to beam-search requests."""

    def __init__(
        self,
        manager: BlockManager,
        placement: Placement,
        records: Records,
        counters: SchedulerCounters,
    ) -> None:
        self.manager = manager
        self.placement = placement
        self.records = records
        self.counters = counters

    def decode(
        self,
        rows: npt.NDArray[np.int64],
        output: SchedulerOutput,
        result: ModelStepResult,
        upd: UpdateState,
    ) -> None:
        """Step the beams of the decode-table ``rows`` (beam rows of this step)."""
        cols = self.placement.table.cols
        owner = self.placement.registry.owner
        topk_ids = np.asarray(result.topk_token_ids)
        topk_lps = np.asarray(result.topk_logprobs)
        # The decode rows are the first rows of the step, in the same order as seq_ids.
        row_in_step = {int(s): i for i, s in enumerate(output.seq_ids[: output.num_decode_seqs])}
        groups: dict[int, list[int]] = defaultdict(list)
        for row in rows.tolist():
            groups[int(cols["counter"][row])].append(row)
        for group in groups.values():
            seq_ids = [int(cols["seq_id"][r]) for r in group]
            state = owner[seq_ids[0]]
            if state.aborted:
                continue
            upd.remove_rows.append(np.array(group, dtype=np.int64))
            steps = [row_in_step[s] for s in seq_ids]
            self.step(
                state,
                seq_ids,
                cols["cum_logprob"][group].astype(np.float64),
                int(cols["num_tokens"][group[0]]),
                int(cols["num_generated"][group[0]]),
                topk_ids[steps],
                topk_lps[steps],
                upd,
            )

    def step(
        self,
        state: RequestState,
        parents: list[int],
        cums: npt.NDArray[np.float64],
        num_tokens: int,
        num_generated: int,
        topk_ids: npt.NDArray[np.int64],
        topk_lps: npt.NDArray[np.float32],
        upd: UpdateState,
    ) -> None:
        """Extend the live beams by one token: fork, free and commit their sequences."""
        mgr = self.manager
        placement = self.placement
        params = state.params
        width = params.beam_width
        choices, ended = select_beams(cums, topk_ids, topk_lps, width, state.beam_stops)
        self.counters.num_generated_tokens += len(choices) + len(ended)
        start = state.num_prompt
        tokens_of: dict[int, list[int]] = {}

        def history(parent: int) -> list[int]:
            if parent not in tokens_of:
                tokens_of[parent] = mgr.token_ids(parents[parent])[start:].tolist()
            return tokens_of[parent]

        for parent, token, score, _ in ended:
            reason = FinishReason.EOS if token == state.eos else FinishReason.STOP
            state.hypotheses.append(Hypothesis([*history(parent), token], score, reason))
        generated = num_generated + 1
        if len(state.hypotheses) >= width or generated >= params.max_tokens or not choices:
            if generated >= params.max_tokens:
                for choice in choices:
                    state.hypotheses.append(
                        Hypothesis(
                            [*history(choice.parent), choice.token],
                            choice.cum_logprob,
                            FinishReason.LENGTH,
                        )
                    )
            for seq in parents:
                placement.release_seq(state, seq)
            upd.finished.append(self.records.finish_request(state, upd.now, upd.step))
            return
        used: set[int] = set()
        seq_ids: list[int] = []
        registry = placement.registry
        for choice in choices:
            if choice.parent in used:
                child = registry.new_seq_id()
                mgr.fork(parents[choice.parent], child)
                registry.adopt(state, child, len(state.all_seq_ids))
                seq_ids.append(child)
            else:
                used.add(choice.parent)
                seq_ids.append(parents[choice.parent])
        for index, seq in enumerate(parents):
            if index not in used:
                placement.release_seq(state, seq)
        tokens = np.array([c.token for c in choices], dtype=np.int64)
        mgr.commit_batch(np.array(seq_ids, dtype=np.int64), 0, tokens)
        state.seq_ids = seq_ids
        state.multi = True
        state.status = RequestStatus.RUNNING
        upd.add_rows.append(
            state.table_rows(
                np.array(seq_ids, dtype=np.int64),
                tokens,
                num_tokens + 1,
                generated,
                np.array([c.cum_logprob for c in choices], dtype=np.float64),
            )
        )
