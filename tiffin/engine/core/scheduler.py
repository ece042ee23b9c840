"""Iteration-level scheduling: each step spends a token budget on running sequences, then waiting ones.

A scheduled sequence computes `num_scheduled_tokens` tokens starting at its `num_computed_tokens`; prefill
chunks and single decode tokens share one forward. A sequence samples when this step brings its computed
tokens up to all of its tokens. With `prefill_first`, a step that can admit waiting sequences leaves the
running ones' decodes to the next step, which always includes them: a decode batch never delays a first token,
and decodes wait at most every other step. When blocks run out, the most recently admitted running sequence is
preempted by recompute: its blocks are freed and it goes back to the head of the waiting queue.

A pooling sequence (embeddings, scores) runs its whole prompt in one step, with no prefix-cache hit, and finishes
in it: its hidden states all come from that step's forward, and an encoder's attention sees the whole prompt. A
step held below a waiting prompt to pool (`step_budget`: an engine yielding to another, tiffin.engine.turns)
schedules none of it: the turns save the budget up until it fits.
"""

from collections import deque
from dataclasses import dataclass, field

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)  # whether each sequence samples a token this step
    sampling_seqs: list[Sequence] = field(default_factory=list)  # those that do, in order: one logits row each
    pooling_seqs: list[Sequence] = field(default_factory=list)  # pooling sequences, in order: one pooled row each

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        pools = seq.pooling_params is not None
        samples = seq.num_computed_tokens + num_new_tokens == seq.num_tokens and not pools
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_new_tokens)
        self.sampling.append(samples)
        if samples:
            self.sampling_seqs.append(seq)
        if pools:
            self.pooling_seqs.append(seq)

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
        self.last_step_skipped_decodes = False  # the last step left running decodes out
        self.step_budget: int | None = None  # tokens of the next steps, when held below max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        prefill_only = self.prefill_first and bool(self.waiting) and not self.last_step_skipped_decodes
        out = self._schedule(decodes=not prefill_only)
        if prefill_only and not out.seqs:  # no waiting sequence could be admitted
            prefill_only, out = False, self._schedule(decodes=True)
        self.last_step_skipped_decodes = prefill_only and len(out.seqs) < len(self.running)  # scheduled ones all run
        return out

    def _schedule(self, decodes: bool) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.step_budget or self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining == 1 and not decodes:  # a prefill chunk cut to one token by the budget is not a decode
                i += 1
                continue
            num_new = min(remaining, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.add(seq, num_new)
                budget -= num_new
                i += 1
        adapters, skipped = self._running_adapters(), []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            # Every adapter slot is taken, or its grammar is still compiling: let others pass meanwhile.
            if not self._lora_fits(seq, adapters) or (seq.grammar is not None and not seq.grammar.ready):
                skipped.append(self.waiting.popleft())
                continue
            pools = seq.pooling_params is not None
            cached = [] if pools else self.block_manager.get_computed_blocks(seq)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if (pools and num_new < seq.num_tokens) or not self.block_manager.allocate_slots(seq, num_new, cached):
                break
            self.waiting.popleft()
            self._count_cache_lookup(seq, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def update(self, out: SchedulerOutput, sampled: list[int], pooled: list[list[float]] = ()) -> list[Sequence]:
        """Advance the scheduled sequences past this step; append the sampled tokens (one per sampling
        sequence, in order) and finish the sequences they stop; finish the pooling sequences with their result
        (one per pooling sequence, in order). Returns the sequences that got a token or a result."""
        for seq, num_new in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += num_new
        got_token = []
        for seq, result in zip(out.pooling_seqs, pooled):
            if not seq.finished:
                seq.pooled = result
                self.finish(seq, "stop")
                got_token.append(seq)
        for seq, token in zip(out.sampling_seqs, sampled):
            if not seq.finished:  # aborted while its step ran
                seq.append_token(token)
                self._check_stop(seq)
                got_token.append(seq)
        return got_token

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` (stopped, aborted, or failed) and free its blocks at once."""
        seq.finish(reason, stop_reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        if seq.grammar is not None:
            seq.grammar.drop()  # rebuilt from its tokens when it runs again
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _count_cache_lookup(self, seq: Sequence, num_cached: int) -> None:
        if seq.num_output_tokens == 0:  # first admission, not a readmission after preemption
            seq.num_cached_tokens = num_cached
        self.block_manager.prefix_cache_queries += seq.num_tokens
        self.block_manager.prefix_cache_hits += num_cached
