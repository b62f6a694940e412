"""BucketRound, the scheduler of overlapped DDP, ZeRO-2 and FSDP: counting, order, the end of backward."""

import weakref

import pytest
import torch

from dpcourse.ddp.rounds import BucketRound


class Recorder:
    """Stands for a wrapper: launches and finishes are logged, handles are names."""

    def __init__(self, sizes):
        self.log = []
        self.round = BucketRound(sizes, self.launch, on_backward_end=self.end, finish=self.finish)

    def launch(self, b):
        self.log.append(("launch", b))
        return f"h{b}"

    def finish(self, b, handle):
        self.log.append(("finish", b, handle))

    def end(self):
        self.log.append(("end",))
        self.round.finish()


def test_a_bucket_launches_when_its_last_gradient_arrives_and_only_in_bucket_order():
    r = Recorder([2, 1, 1])
    r.round.ready(1)  # bucket 1 is complete, but bucket 0 is not: nothing may start
    assert r.log == []
    r.round.ready(0)
    assert r.log == []
    r.round.ready(0)  # bucket 0 complete: 0 and the waiting 1 start, in order
    assert r.log == [("launch", 0), ("launch", 1)]
    r.round.ready(2)
    assert r.log[-1] == ("launch", 2) and r.round.next == 3


def test_finish_launches_the_rest_in_order_then_waits_oldest_first_and_resets():
    r = Recorder([1, 2, 1])
    r.round.ready(0)
    r.round.ready(2)  # bucket 1 still misses both gradients: finish counts them as zeros
    r.round.finish()
    assert r.log == [("launch", 0), ("launch", 1), ("launch", 2),
                     ("finish", 0, "h0"), ("finish", 1, "h1"), ("finish", 2, "h2")]
    assert r.round.pending == [1, 2, 1] and r.round.next == 0 and r.round.inflight == []


def test_wait_keeps_the_newest_in_flight():
    r = Recorder([])
    for name in "abc":
        r.round.launched(name, name.upper())
    r.round.wait(keep=1)
    assert r.log == [("finish", "a", "A"), ("finish", "b", "B")]
    assert r.round.inflight == [("c", "C")]


def test_a_gradient_for_a_launched_bucket_is_refused():
    r = Recorder([1, 1])
    r.round.ready(0)
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        r.round.ready(0)


def test_start_queues_the_end_callback_once_per_backward():
    r = Recorder([1, 1])
    w = torch.ones(2, requires_grad=True)
    v = torch.ones(2, requires_grad=True)

    def hook(b):
        def fn(param):
            r.round.start()
            r.round.ready(b)
        return fn

    w.register_post_accumulate_grad_hook(hook(0))
    v.register_post_accumulate_grad_hook(hook(1))
    one_backward = [("launch", 0), ("launch", 1), ("end",), ("finish", 0, "h0"),
                    ("finish", 1, "h1")]
    for _ in range(2):
        (w * v).sum().backward()
        assert not r.round.in_backward and r.round.next == 0
    assert r.log == one_backward * 2


def test_the_round_does_not_keep_its_owner_alive():
    r = Recorder([1])
    ref = weakref.ref(r)
    del r  # no reference cycle: freed at once, without the garbage collector
    assert ref() is None
