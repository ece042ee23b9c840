"""Iteration-level scheduling: each step spends a token budget on running sequences, then waiting ones.

A scheduled sequence computes `num_scheduled_tokens` tokens starting at its `num_computed_tokens`; prefill
chunks and single decode tokens share one forward. A sequence samples when this step brings its computed
tokens up to all of its tokens. With `prefill_first`, a step that can admit waiting sequences leaves the
running ones' decodes to the next step, which always includes them: a decode batch never delays a first token,
and decodes wait at most every other step.

The scheduling policy orders sequences by a key: under `fcfs` arrival (seq_id), under `priority` (priority,
arrival), lower first. Admission follows the key across both queues (`waiting`, and `swapped`: sequences
preempted by swap): a swapped sequence whose key is before the next waiting one's resumes before it is admitted,
and nothing is admitted past a sequence that cannot be, except one whose adapter finds no free LoRA slot or whose
grammar still compiles: others pass it meanwhile. Swapped sequences hold seats of max_num_seqs, as running ones
do. With `fair_share`, the next waiting sequence is instead the head of the client (`Sequence.client`; all
anonymous requests are one client) that holds the fewest seats, its best priority level, then earliest arrival,
breaking ties: backlogged clients hold about as many seats each, whatever their request rates and whatever
priorities they ask for (a priority orders a client's own requests; across clients it only breaks a tie of seats).
And a client waiting with no seat while every seat is taken gets one at once: the latest admitted sequence of the
client holding the most seats (two at least) is preempted by recompute (its blocks stay in the prefix cache), so a
burst of long requests cannot keep a newcomer waiting until one of them ends.

When blocks run out, the last running sequence is preempted: `running` is in admission order under `fcfs` (the
latest admitted goes) and in key order under `priority` (the lowest priority's latest arrival goes). A higher
priority never preempts a running sequence to be admitted. By recompute: its blocks are freed, its grammar
dropped, and it goes back to `waiting` to compute its tokens again, at its place by the key (plain `fcfs`: at
the head). By swap (`preemption_mode` swap, while the swap region has room): its computed tokens' blocks are
copied to host blocks, its device blocks freed, and it waits in `swapped` (key order), keeping its computed
tokens and grammar, to be copied back.

A pooling sequence (embeddings, scores) runs its whole prompt in one step, with no prefix-cache hit, and finishes
in it: its hidden states all come from that step's forward, and an encoder's attention sees the whole prompt. A
step held below a waiting prompt to pool (`step_budget`: an engine yielding to another, tiffin.engine.turns)
schedules none of it: the turns save the budget up until it fits.

Prompt logprobs (`SamplingParams.prompt_logprobs`) come from the logits of every prompt position, which only a
forward over it computes: a sequence that still needs some skips the prefix cache on admission (as vLLM's does), so
its prompt runs whole, in chunks, each contributing its positions (`SchedulerOutput.prompt_rows`). Once they are
all in (preempted by recompute after its prompt ran) it reads the cache as any other.

Speculative decoding: a decode may carry its sequence's proposals (`spec_token_ids`, set between `schedule` and
the step's forward, then `schedule_proposals`), computed as more query tokens of the same step and verified by
its logits rows, one per proposal plus one: at most `num_speculative_tokens` proposals. Proposals only use what
the step leaves (budget, free blocks): they never preempt. `update` keeps the accepted proposals and one more
token, gives back the slots of the rejected ones (their KV stays unread, then overwritten) and clears every
proposal.
"""

import bisect
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.kv_offload import KVCopies
from tiffin.engine.core.request_queue import FCFSQueue, KeyedQueue, SchedulingKey
from tiffin.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)  # whether each sequence samples a token this step
    sampling_seqs: list[Sequence] = field(default_factory=list)  # those that do, in order: one logits row each
    pooling_seqs: list[Sequence] = field(default_factory=list)  # pooling sequences, in order: one pooled row each
    # (index in seqs, first position, rows): the prompt positions whose logits give prompt logprobs, those of
    # prompt tokens first + 1 ... first + rows, for the sequences that ask
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    copies: KVCopies = field(default_factory=KVCopies)  # their order: core/kv_offload (`LLMEngine.step` sets them)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        pools = seq.pooling_params is not None
        computed = seq.num_computed_tokens + num_new_tokens - len(seq.spec_token_ids)
        samples = computed == seq.num_tokens and not pools
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_new_tokens)
        self.sampling.append(samples)
        if samples:
            self.sampling_seqs.append(seq)
        if pools:
            self.pooling_seqs.append(seq)
        if seq.needs_prompt_logprobs:  # from the first position lacking them to the prompt's last but one
            first = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
            rows = min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1) - first
            if rows > 0:
                self.prompt_rows.append((len(self.seqs) - 1, first, rows))

    def decodes(self) -> list[Sequence]:
        """The sequences that decode one token this step (those that may speculate)."""
        return [s for s, n, samples in zip(self.seqs, self.num_scheduled_tokens, self.sampling) if n == 1 and samples]

    def select(self, keep: list[int]) -> "SchedulerOutput":
        out = SchedulerOutput()
        for i in keep:
            out.add(self.seqs[i], self.num_scheduled_tokens[i])
        return out


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.max_loras = config.max_loras if config.enable_lora else None
        self.prefill_first = config.prefill_first
        self.swap = config.preemption_mode == "swap"
        self.by_priority = config.scheduling_policy == "priority"
        self.fair_share = config.fair_share
        self.last_step_skipped_decodes = False  # the last step left running decodes out
        self.step_budget: int | None = None  # tokens of the next steps, when held below max_num_batched_tokens
        self.waiting = KeyedQueue(self.key, self.fair_share) if self.by_priority or self.fair_share else FCFSQueue()
        self.running: list[Sequence] = []
        self.in_flight: set[Sequence] = set()  # running, in a batch not returned yet (tiffin.engine.pipelined)
        self.swapped: list[Sequence] = []  # preempted by swap, in key order
        self.num_preemptions = 0  # by recompute or swap
        self.num_swapped_out = self.num_swapped_in = 0  # sequences
        self.num_prefill_tokens = 0  # tokens computed before a sequence's newest one (prompts, recomputes)
        self.num_generated_tokens = 0
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0  # speculative decoding totals
        spec = config.speculative_config
        # how often the proposal at each position was accepted: a prefix is, so the counts never grow with position
        self.spec_accepted_per_pos = np.zeros(0 if spec is None else spec.num_speculative_tokens, dtype=np.int64)

    def key(self, seq: Sequence) -> SchedulingKey:
        """Its place in the scheduling order (fcfs: every sequence at level 0)."""
        return (seq.priority if self.by_priority else 0, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """`budget`: this step's tokens when fewer than the usual (a batch's share, tiffin.engine.pipelined)."""
        prefill_only = self.prefill_first and bool(self.waiting) and not self.last_step_skipped_decodes
        out = self._schedule(not prefill_only, budget)
        if prefill_only and not out.seqs:  # no waiting sequence could be admitted
            prefill_only, out = False, self._schedule(True, budget)
        # scheduled ones all run; those in flight were not skipped
        self.last_step_skipped_decodes = prefill_only and len(out.seqs) < len(self.running) - len(self.in_flight)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            prefill_end = max(seq.num_prompt_tokens, seq.num_tokens - 1)
            self.num_prefill_tokens += max(min(seq.num_computed_tokens + n, prefill_end) - seq.num_computed_tokens, 0)
        return out

    def _schedule(self, decodes: bool, budget: int | None) -> SchedulerOutput:
        out, budget = SchedulerOutput(), budget or self.step_budget or self.max_num_batched_tokens
        if self.fair_share:
            self._seat_a_newcomer()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            # a prefill chunk cut to one token by the budget is not a decode
            if (remaining == 1 and not decodes) or seq in self.in_flight:
                i += 1
                continue
            num_new = min(remaining, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                preempted = True
                victim = next(s for s in reversed(self.running) if s not in self.in_flight)
                self.running.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.add(seq, num_new)
                budget -= num_new
                i += 1
        adapters, skipped = self._running_adapters(), []
        seats = Counter(s.client for s in (*self.running, *self.swapped)) if self.fair_share else None
        while (self.waiting or self.swapped) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            head = self.waiting.peek(seats) if self.waiting else None
            if self.swapped and (head is None or self.key(self.swapped[0]) < self.key(head)):
                seq = self.swapped[0]
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self._lora_fits(seq, adapters) or not self.block_manager.swap_in(seq, num_new):
                    break
                del self.swapped[0]
                self.num_swapped_in += 1
                self._run(seq)
                out.add(seq, num_new)
                budget -= num_new
                continue
            if len(self.running) + len(self.swapped) >= self.max_num_seqs:
                break
            seq = head
            # Every adapter slot is taken, or its grammar is still compiling: let others pass meanwhile.
            if not self._lora_fits(seq, adapters) or (seq.grammar is not None and not seq.grammar.ready):
                self.waiting.pop(seq)
                skipped.append(seq)
                continue
            pools = seq.pooling_params is not None
            skip_cache = pools or seq.needs_prompt_logprobs
            cached = [] if skip_cache else self.block_manager.get_computed_blocks(seq)  # None: in the host tier
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if (pools and num_new < seq.num_tokens) or not self.block_manager.allocate_slots(seq, num_new, cached):
                break
            self.waiting.pop(seq)
            self._count_cache_lookup(seq, num_cached, cached.count(None) * self.block_manager.block_size)
            seq.num_computed_tokens = num_cached
            self._run(seq)
            if seats is not None:
                seats[seq.client] += 1
            out.add(seq, num_new)
            budget -= num_new
        for seq in reversed(skipped):  # back in their order (fcfs: at the head)
            self.waiting.requeue(seq)
        return out

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if self.by_priority:  # the last running sequence is the next to preempt
            bisect.insort(self.running, seq, key=self.key)
        else:
            self.running.append(seq)

    def schedule_proposals(self, out: SchedulerOutput) -> None:
        """Extend the step's decodes by their sequences' proposals as far as the step's token budget, the context,
        max_tokens and free blocks allow; drop the rest."""
        budget = (self.step_budget or self.max_num_batched_tokens) - sum(out.num_scheduled_tokens)
        for i, seq in enumerate(out.seqs):
            if not seq.spec_token_ids:
                continue
            room = min(budget, seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = max(min(len(seq.spec_token_ids), room, len(self.spec_accepted_per_pos)), 0)
            if k and not self.block_manager.allocate_slots(seq, 1 + k):
                k = 0
            del seq.spec_token_ids[k:]
            seq.spec_probs = None if seq.spec_probs is None or not k else seq.spec_probs[:k]
            out.num_scheduled_tokens[i] += k
            budget -= k
            self.spec_drafts += k > 0
            self.spec_draft_tokens += k

    def update(
        self,
        out: SchedulerOutput,
        sampled: list[int],
        pooled: list[list[float]] = (),
        accepted: list[bool] | None = None,
        logprobs: list | None = None,
        prompt_logprobs: list[list] = (),
    ) -> list[Sequence]:
        """Advance the scheduled sequences past this step, add their prompt logprobs (one list per `out.prompt_rows`
        entry) and finish the pooling sequences with their result (one per pooling sequence, in order). `sampled`,
        `accepted` and `logprobs` have one entry per logits row (a sampling sequence has one, or one per proposal
        plus one): a sequence takes its accepted proposals, then the token of its first row that rejects (or of its
        last row), each checked for a stop. Returns the sequences that got a token or a result."""
        for seq, num_new in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += num_new
        for (i, _, _), entries in zip(out.prompt_rows, prompt_logprobs):
            out.seqs[i].prompt_logprobs += entries
        got_token = []
        for seq, result in zip(out.pooling_seqs, pooled):
            if not seq.finished:
                seq.pooled = result
                self.finish(seq, "stop")
                got_token.append(seq)
        row, accepted_lens = 0, []
        for seq in out.sampling_seqs:
            spec, seq.spec_token_ids, seq.spec_probs = seq.spec_token_ids, [], None
            rows = range(row, row + len(spec) + 1)
            row = rows.stop
            num_accepted = next((j for j in range(len(spec)) if not accepted[rows[j]]), len(spec))
            accepted_lens.append(num_accepted)
            if seq.finished:  # aborted while its step ran
                continue
            seq.num_computed_tokens -= len(spec) - num_accepted
            for r in rows[: num_accepted + 1]:
                seq.append_token(sampled[r])
                self.num_generated_tokens += 1
                if logprobs is not None and logprobs[r] is not None:
                    seq.logprobs.append(logprobs[r])
                self._check_stop(seq)
                if seq.finished:
                    break
            if spec and not seq.finished:
                self.block_manager.trim(seq, seq.num_tokens)
            got_token.append(seq)
        if any(accepted_lens):
            self._count_accepted(accepted_lens)
        return got_token

    def _count_accepted(self, accepted_lens: list[int]) -> None:
        """Count a step's accepted proposals: position i was accepted in each decode that accepted more than i."""
        per_pos = self.spec_accepted_per_pos
        per_pos += (np.arange(len(per_pos)) < np.array(accepted_lens)[:, None]).sum(0)
        self.spec_accepted_tokens += sum(accepted_lens)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` (stopped, aborted, or failed) and free its blocks at once."""
        seq.finish(reason, stop_reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        self.block_manager.free_seq(seq)

    def _check_stop(self, seq: Sequence) -> None:
        """The one place that decides a sequence stops (aborts aside), after each token. In this order: its
        structured-outputs grammar (rejected token: "error"; ended: "stop"), an EOS or stop token (once
        min_tokens are out), the length limits, a stop string its detokenizer matched."""
        token, params = seq.token_ids[-1], seq.params
        if seq.grammar is not None:  # a rejected token fails the sequence; an ended grammar stops it
            verdict = seq.grammar.verdict(seq.output_token_ids)
            if verdict is not None:
                return self.finish(seq, *verdict)
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in seq.eos_token_ids:
                return self.finish(seq, "stop", None)
            if token in params.stop_token_set:
                return self.finish(seq, "stop", token)
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return self.finish(seq, "length")
        if seq.detokenizer is not None and seq.detokenizer.stopped is not None:
            self.finish(seq, "stop", seq.detokenizer.stopped)

    def _running_adapters(self) -> set[bytes] | None:
        """Distinct LoRA adapters among running sequences (None: LoRA off). Keeping them within max_loras keeps
        every step's adapters within the device slots, since a step only runs running sequences."""
        if self.max_loras is None:
            return None
        return {s.lora.identity for s in self.running if s.lora is not None}

    def _lora_fits(self, seq: Sequence, adapters: set[bytes] | None) -> bool:
        """Whether admitting `seq` keeps the running adapters within max_loras; counts it in if so."""
        if adapters is None or seq.lora is None or seq.lora.identity in adapters:
            return True
        if len(adapters) >= self.max_loras:
            return False
        adapters.add(seq.lora.identity)
        return True

    def _seat_a_newcomer(self) -> None:
        if not self.waiting or len(self.running) + len(self.swapped) < self.max_num_seqs:
            return
        seats = Counter(s.client for s in (*self.running, *self.swapped))
        ready = lambda seq: (
            (seq.grammar is None or seq.grammar.ready) and self._lora_fits(seq, self._running_adapters())
        )
        if not any(seats[seq.client] == 0 and ready(seq) for seq in self.waiting.heads()):
            return
        holder = max({s.client for s in self.running}, key=seats.__getitem__, default=None)
        if holder is None or seats[holder] < 2:
            return
        victim = next((s for s in reversed(self.running) if s.client == holder and s not in self.in_flight), None)
        if victim is None:
            return
        self.running.remove(victim)
        self._preempt(victim, swap=False)  # a swapped sequence keeps its seat

    def _preempt(self, seq: Sequence, swap: bool = True) -> None:
        """By swap when that is the mode and the swap region has room (its grammar stays as it is: its tokens do
        not change), else by recompute."""
        self.num_preemptions += 1
        if swap and self.swap and self.block_manager.swap_out(seq):
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=self.key)
            self.num_swapped_out += 1
            return
        self.block_manager.free_seq(seq)
        if seq.grammar is not None:
            seq.grammar.drop()  # rebuilt from its tokens when it runs again
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.requeue(seq)

    def _count_cache_lookup(self, seq: Sequence, num_cached: int, num_loaded: int) -> None:
        if seq.num_output_tokens == 0:  # first admission, not a readmission after preemption
            seq.num_cached_tokens = num_cached
        self.block_manager.prefix_cache_queries += seq.num_tokens
        self.block_manager.prefix_cache_hits += num_cached
        self.block_manager.host_tier_hits += num_loaded
