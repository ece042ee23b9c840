"""StepTurns: engines sharing a device step one at a time, in arrival order; a yielding engine's steps are held
to a share of the other's while it has work."""

import threading
import time

from tiffin.engine.turns import StepTurns


def test_two_busy_engines_alternate():
    turns, order, start = StepTurns(), [], threading.Barrier(2)

    def run(name: str) -> None:
        start.wait()
        for _ in range(20):
            with turns.turn(name):
                order.append(name)
                time.sleep(0.002)  # the other is queued by now

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # after the first turn or two (which thread queues first is a race) the two alternate
    tail = order[2:-2]
    assert all(x != y for x, y in zip(tail, tail[1:])), order


def test_a_yielding_engine_is_held_to_a_share_of_the_others_step_only_while_it_has_work():
    turns = StepTurns(share=0.5)
    chat, embedder = object(), object()
    turns.join(chat)
    turns.join(embedder, yields=True)
    assert turns.budget(embedder, 4096) == 4096  # nothing measured yet
    turns.stepped(embedder, seconds=0.1, tokens=1000, busy=True)  # 10,000 tokens/s
    assert turns.budget(embedder, 4096) == 4096  # the chat engine has no work
    turns.stepped(chat, seconds=0.02, tokens=32, busy=True)
    assert turns.budget(embedder, 4096) == 100  # 0.5 x 20 ms at 10,000 tokens/s
    assert turns.budget(chat, 4096) == 4096  # the chat engine never yields
    turns.stepped(embedder, seconds=0.001, tokens=0, busy=True)  # held below its next prompt: ran nothing
    assert turns.budget(embedder, 4096) == 100  # no chat step since: nothing more granted
    turns.stepped(chat, seconds=0.02, tokens=32, busy=True)
    assert turns.budget(embedder, 4096) == 200  # saved up, turn after turn
    turns.stepped(embedder, seconds=0.01, tokens=150, busy=True)  # ran: what it left is not saved
    turns.stepped(chat, seconds=0.02, tokens=32, busy=True)
    assert turns.budget(embedder, 4096) == 115  # its speed now 0.7 x 10,000 + 0.3 x 15,000
    turns.stepped(chat, seconds=0.02, tokens=1, busy=False)
    assert turns.budget(embedder, 4096) == 4096
