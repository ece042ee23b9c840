"""Several batches in flight through the pipeline's stages (vLLM's batch queue, `pipeline_batches_in_flight`, by
default one per stage): while the last stage computes batch k, rank 0 schedules batch k+1 and runs the first stage
on it, so that every stage works at once instead of taking turns.

Invariant: a sequence is in at most one batch in flight. The scheduler skips the running sequences of a batch that
has not returned (`Scheduler.in_flight`) and never preempts one; they are scheduled again once its outputs have
advanced them. Every stage runs the batches in the order they were started, so a batch scheduled after another
reads what that one wrote to the KV cache at every stage, whichever blocks the scheduler handed on meanwhile
(a finished sequence's, a prefix hit on blocks still being filled)."""

import itertools
from collections import deque

from tiffin.engine.errors import EngineDeadError
from tiffin.engine.outputs import RequestOutput
from tiffin.engine.worker.model_runner import StepInFlight


class BatchQueue:
    """The batches an `LLMEngine` has in flight, oldest first."""

    def __init__(self, engine, depth: int):
        self.engine, self.depth = engine, depth
        self.batches: deque[StepInFlight] = deque()

    def step(self) -> list[RequestOutput]:
        """Start a batch if fewer than `depth` are in flight and one can be scheduled; unless that leaves room for
        another, finish the oldest and return its outputs."""
        engine = self.engine
        if len(self.batches) < self.depth:
            scheduler_output = engine.schedule_step(self._share())
            if scheduler_output.seqs:
                try:
                    self.batches.append(engine.model_runner.start_step(scheduler_output))
                except EngineDeadError:
                    raise
                except Exception:
                    return self._run_alone(scheduler_output)
                engine.scheduler.in_flight.update(scheduler_output.seqs)
                if len(self.batches) < self.depth:
                    return []
        if not self.batches:
            engine._wait_for_grammars()
            return []
        return self._finish_oldest()

    def _share(self) -> int:
        """The token budget of the batch about to start: what can be scheduled split evenly over the batches that
        can start before the oldest returns, so that consecutive batches, each stage's consecutive work, are alike
        (a step that took every waiting prompt would leave the next batch a remainder, and each decode step after
        it that imbalance)."""
        scheduler, slots = self.engine.scheduler, self.depth - len(self.batches)
        budget = scheduler.step_budget or scheduler.max_num_batched_tokens
        ready = (s for s in scheduler.running if s not in scheduler.in_flight)
        pending = 0
        for seq in itertools.chain(ready, scheduler.swapped, scheduler.waiting):
            pending += seq.num_tokens - seq.num_computed_tokens
            if pending >= budget * slots:
                return budget
        return max(1, -(-pending // slots))

    def _finish_oldest(self) -> list[RequestOutput]:
        engine, step = self.engine, self.batches.popleft()
        engine.scheduler.in_flight.difference_update(step.scheduler_output.seqs)
        try:
            sampled = engine.model_runner.finish_step(step)
        except EngineDeadError:
            raise
        except Exception:
            return self._run_alone(step.scheduler_output)
        return engine.finish_step(step.scheduler_output, sampled)

    def _run_alone(self, scheduler_output) -> list[RequestOutput]:
        """A batch that raised outside the stages' exchange (which would break the group): the batches in flight
        finish first, then it runs again as the one-batch engine runs a failing step, halved until the requests
        at fault fail alone (`LLMEngine._execute`)."""
        outputs = []
        while self.batches:
            outputs += self._finish_oldest()
        return outputs + self.engine.finish_step(*self.engine._execute(scheduler_output))
