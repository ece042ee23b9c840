"""A draft model (vLLM's `draft_model` method): a smaller model sharing the target's tokenizer generates
`num_speculative_tokens` (k) tokens per round on its own paged KV cache, and proposes them.

Each target sequence has a shadow sequence in the draft, keyed by its seq_id: the target's tokens, then the
draft's last proposals, of which only the accepted ones keep their KV next round. A round runs k batched
forwards over all shadows: the first computes every shadow's uncomputed tokens (a new prompt, or the tokens
accepted since), the later ones the token drafted just before (plain decodes: on CUDA they replay the draft's own
decode graphs, captured for up to max_num_seqs rows); each samples one proposal per shadow. A greedy
sequence gets the draft's argmax; a sampled one a draw from the draft's distribution q (temperature, min-p,
top-k, top-p as the target's sampler; penalties left out: any q is lossless when the draw follows it), which
`spec_probs` reports, except with a seed (`_sample`). Slots for a whole round are allocated before any proposal
joins a shadow's tokens, so the draft's prefix cache only ever hashes the target's tokens."""

import contextlib
import dataclasses
import os

import torch

from tiffin import kernels
from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.loader import get_model_config
from tiffin.engine.models.source import resolve_model_path
from tiffin.engine.speculative_config import SpeculativeConfig
from tiffin.engine.worker.batch import Upload
from tiffin.engine.worker.model_runner import ModelRunner
from tiffin.engine.worker.sampler import _GREEDY_EPS, Sampler, sampling_probs


def load_draft(
    config: SpeculativeConfig, engine_config: EngineConfig, target_config: ModelConfig, max_model_len: int
) -> ModelRunner:
    """The runner of `config.model`, its weights loaded, not started: the target's runner sizes its KV pool with
    the draft's and starts it on as many blocks (`ModelRunner.start`). ValueError when the draft cannot generate,
    or has tokens the target (`target_config`) has not."""
    path = resolve_model_path(config.model)
    model_config, vocab = get_model_config(path), target_config.vocab_size
    if model_config.task != "generate":
        raise ValueError(f"draft model {config.model!r} cannot generate (it serves {model_config.task!r})")
    if model_config.vocab_size > vocab:
        raise ValueError(
            f"draft model {config.model!r} has vocab_size {model_config.vocab_size}, more than the target's "
            f"{vocab}: a draft must share the target's tokenizer"
        )
    model_config.dtype = target_config.dtype
    draft_config = dataclasses.replace(
        engine_config,
        model=path,
        tokenizer=engine_config.tokenizer or engine_config.model,
        max_model_len=max_model_len,
        enable_lora=False,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        speculative_config=None,
        kv_offload_memory=0,  # its shadows' KV is cheap to recompute: no host blocks
        preemption_mode="recompute",
    )
    return ModelRunner(draft_config, model_config, max_model_len, set(), start=False)


class DraftProposer:
    def __init__(
        self, config: SpeculativeConfig, engine_config: EngineConfig, target: ModelRunner, runner: ModelRunner
    ):
        """`runner`: `load_draft`'s, started by `target`."""
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size)
        self.k, self.max_model_len = config.num_speculative_tokens, target.max_model_len
        self.vocab = target.model_config.vocab_size
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        self.shadows: dict[int, Sequence] = {}
        self.sampler = Sampler(set(), engine_config.seed)
        self.check_invariants = os.environ.get("TIFFIN_CHECK_INVARIANTS") == "1"

    def propose(self, seqs: list[Sequence]) -> None:
        """Draft for `seqs`; the shadows of sequences not among them (finished, preempted, aborted) are freed. A
        round that raises drops every shadow before it raises: a failed forward leaves some of their slots
        unwritten, maybe hashed, and the next round starts them over from the target's tokens."""
        for seq_id in self.shadows.keys() - {s.seq_id for s in seqs}:
            self.block_manager.free_seq(self.shadows.pop(seq_id))
        try:
            self._round(seqs)
        except Exception:
            self._drop_shadows()
            raise
        finally:
            if self.check_invariants:
                self.block_manager.check_invariants(self.shadows.values())

    def _round(self, seqs: list[Sequence]) -> None:
        step, budget, drafting = SchedulerOutput(), self.max_num_batched_tokens, []
        for seq in seqs:
            n = min(self.k + 1, seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            scheduled = self._schedule(seq, n, budget) if n > 0 and budget > 0 else None
            if scheduled is not None:
                step.add(*scheduled)
                budget -= scheduled[1]
                drafting += [(seq, n)] if step.sampling[-1] else []
        if step.seqs:
            self._draft(step, drafting)

    def _drop_shadows(self) -> None:
        """Free every shadow, unhashing the blocks past its computed tokens (their KV may not be what the hash says)."""
        for shadow in self.shadows.values():
            self.block_manager.forget_uncomputed(shadow)
            self.block_manager.free_seq(shadow)
        self.shadows.clear()

    def _schedule(self, seq: Sequence, n: int, budget: int) -> tuple[Sequence, int] | None:
        """`seq`'s synced shadow, given the slots of its round, and the tokens its first step computes: at most
        `budget`, so that a longer prompt is prefilled over rounds, proposing nothing until done. None, the shadow
        dropped, when the draft's pool cannot hold it."""
        shadow, bm = self._sync(seq), self.block_manager
        cached = [] if shadow.block_table else bm.get_computed_blocks(shadow)
        start = max(shadow.num_computed_tokens, len(cached) * bm.block_size)
        chunk = min(shadow.num_tokens - start, budget)
        drafts = n - 1 if start + chunk == shadow.num_tokens else 0
        if not bm.allocate_slots(shadow, chunk + drafts, cached):
            bm.free_seq(self.shadows.pop(seq.seq_id))
            return None
        shadow.num_computed_tokens = start
        return shadow, chunk

    def _sync(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow holding `seq`'s tokens, its KV kept for the prefix it already shared with them."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.index, seq.token_ids, seq.params, seq.max_tokens)
            shadow.prompt_logprobs = None  # the target's logits give them; the draft's prompt rows are not computed
            self.shadows[seq.seq_id] = shadow
            return shadow
        tokens, same = seq.token_ids, max(shadow.num_tokens - self.k, 0)  # only its last k tokens may be drafts
        while same < min(len(tokens), shadow.num_tokens) and shadow.token_ids[same] == tokens[same]:
            same += 1
        shadow.token_ids[same:] = tokens[same:]
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, len(tokens) - 1)
        self.block_manager.trim(shadow, shadow.num_computed_tokens)
        return shadow

    def _draft(self, step: SchedulerOutput, drafting: list[tuple[Sequence, int]]) -> None:
        """Run the round's forwards from its first `step`: each sequence of `drafting` (in the step's sampling
        order) gets its `n` proposals."""
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in drafting}
        for j in range(max((n for _, n in drafting), default=1)):  # a step of prefill chunks alone runs too
            logits = self._forward(step)
            for shadow, num_new in zip(step.seqs, step.num_scheduled_tokens):
                shadow.num_computed_tokens += num_new
            seqs = [seq for seq, n in drafting if n > j]
            if logits is None:  # only prefill chunks ran
                return
            for seq, token in zip(seqs, self._sample(logits, seqs, j, probs)):
                self.shadows[seq.seq_id].token_ids.append(token)
            step = SchedulerOutput()
            for seq, n in drafting:
                if n > j + 1:
                    step.add(self.shadows[seq.seq_id], 1)
        for seq, n in drafting:
            seq.spec_token_ids = self.shadows[seq.seq_id].token_ids[-n:]
            seq.spec_probs = torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None

    @torch.inference_mode()
    def _forward(self, step: SchedulerOutput) -> torch.Tensor | None:
        """The logits of `step`'s sampling shadows, launched on the draft's device whichever thread calls; a step of
        one token per shadow (the round's later ones) replays the draft's decode graphs when it has them."""
        runner = self.runner
        size = 0 if runner.decode_graphs is None else runner.decode_graphs.size_for(step)
        with torch.cuda.device(runner.device) if runner.device.type == "cuda" else contextlib.nullcontext():
            if size:
                return runner.graphed_step(step, Upload(runner.device), size)
            return runner.run_model(runner.prepare(step))[0]

    @torch.inference_mode()
    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], j: int, probs: dict[int, list[torch.Tensor]]
    ) -> list[int]:
        """Proposal `j` of each of `seqs` (one per row of `logits`); appends the q rows of unseeded sampled ones to
        `probs`."""
        tokens = kernels.argmax(logits)
        rows = [i for i, seq in enumerate(seqs) if seq.params.temperature >= _GREEDY_EPS]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            q = sampling_probs(logits[index].float(), [seqs[i].params for i in rows])
            q = torch.nn.functional.pad(q, (0, self.vocab - q.shape[1]))
            seeds = [seqs[i].noise_seed(j) for i in rows]
            # a seeded row races the very noise the target's row for its position will: its proposal is then a
            # deterministic one, accepted exactly when the target draws it, so a seed emits the tokens it emits
            # without speculation however steps were scheduled (a draw reported as q would make them depend on
            # which positions got proposals); the shared noise keeps its acceptance close to q's
            tokens[index] = self.sampler.race(q.clone(), seeds)  # it divides in place; q is reported
            for i, row, seed in zip(rows, q, seeds):
                if seed is None:
                    probs[seqs[i].seq_id].append(row)
        return tokens.tolist()
