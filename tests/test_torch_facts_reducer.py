"""What lessons 06-11 say about torch and gloo, asked of torch itself.

Like ``tests/test_torch_facts.py``: every test asks torch (its process groups over gloo,
DDP, Join, its communication hooks, AdamW), never dpcourse's wrappers, and each names the
lesson section whose sentence it backs. The 2-rank probes run in one launch (a module
fixture), so the file stays fast on a small CPU machine; each test then checks one statement.
"""

from __future__ import annotations

import inspect
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import dpcourse
from test_torch_facts import _profiled, _recording


# --------------------------------------------------------------------------- probes (in the ranks)


def _order_probe(rank):
    """Rank 0 all-reduces x then y; rank 1 issues its tensors the other way round."""
    x, y = torch.tensor([1.0]), torch.tensor([10.0])
    first, second = (x, y) if rank == 0 else (torch.tensor([20.0]), torch.tensor([2.0]))
    dist.all_reduce(first)
    dist.all_reduce(second)
    return [first.item(), second.item()]


def _completion_probe(rank):
    """Rank 0 starts an all-reduce while rank 1 is held back until rank 0 says go."""
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((4,), float(rank + 1))
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        completed = []
        for _ in range(10):  # rank 1 cannot have joined: it waits for "go"
            time.sleep(0.05)
            completed.append(work.is_completed())
        store.set("go", "1")
        work.wait()
        return dict(completed_before_peer=any(completed), value=t.tolist(),
                    completed_after=work.is_completed())
    store.wait(["go"])
    dist.all_reduce(t)
    return dict(value=t.tolist())


def _threads_probe(rank):
    """Start an async all-reduce and never call wait(): does it finish while this thread sleeps?"""
    t = torch.full((1 << 16,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 60
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)  # the calling thread does nothing but sleep
    done, summed = work.is_completed(), bool((t == 3.0).all())
    work.wait()
    return dict(completed_without_wait=done, summed_without_wait=summed)


def _ddp_sync_probe(rank):
    """DDP on a bias-free Linear(3, 1) with a sum loss: the gradient of a batch x is x.sum(0)."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(3, 1, bias=False))

    def batch(r, k):
        return torch.arange(6.0).reshape(2, 3) * (r + 1) + 10 * k

    grads, ops = [], []
    # Two plain steps: backward alone must leave the mean over ranks in .grad.
    for k in range(2):
        ddp.zero_grad()
        out = ddp(batch(rank, k)).sum()
        with _profiled() as p:
            out.backward()
        ops.append(dict(p.ops))
        mean = sum(batch(r, k).sum(0) for r in range(2)) / 2
        grads.append(torch.allclose(ddp.module.weight.grad[0], mean))
    # Accumulation: two micro-steps under no_sync, the third outside.
    ddp.zero_grad()
    acc_ops = []
    for k in range(3):
        ctx = ddp.no_sync() if k < 2 else torch.enable_grad()
        with ctx:
            out = ddp(batch(rank, k)).sum()
            with _profiled() as p:
                out.backward()
        acc_ops.append(dict(p.ops))
    acc_mean = sum(batch(r, k).sum(0) for r in range(2) for k in range(3)) / 2
    return dict(plain_ops=ops, plain_mean=grads, acc_ops=acc_ops,
                acc_mean=torch.allclose(ddp.module.weight.grad[0], acc_mean))


class _OpLog(TorchDispatchMode):
    """Logs (op name, dtypes of tensor inputs, dtype of the output) of every aten/c10d op."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.ops.append((func.__name__, ins, getattr(first, "dtype", None)))
        return out


class _Bucket:
    """The one method torch's 16-bit hooks read from a GradBucket."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer


def _hook_order_probe(rank):
    """Run torch's fp16 and bf16 hooks on a float32 bucket, logging the ops they run."""
    out = {}
    for name, hook in (("fp16", default_hooks.fp16_compress_hook),
                       ("bf16", default_hooks.bf16_compress_hook)):
        buf = torch.tensor([1.0, 3.0, 5.0])
        with _OpLog() as log:
            fut = hook(None, _Bucket(buf))
        fut.wait()
        out[name] = [op for op in log.ops if not op[0].startswith("detach")]
    # 70000 does not fit in float16 (largest 65504) but 70000 / 2 does: casting first
    # overflows to inf, dividing first would send 35000.
    buf = torch.tensor([70000.0 if rank == 0 else 0.0])
    result = default_hooks.fp16_compress_hook(None, _Bucket(buf)).wait()
    out["overflow"] = float(result[0])
    return out


def _join_probe(rank):
    """torch DDP under Join, rank 0 with 3 batches, rank 1 with 1, logging every one-element
    all-reduce (what this rank put in, the reduce op, the tensor) and the collectives of the
    last rank's exit from Join."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 1))
    flags, saved = [], dist.all_reduce

    def logged(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if tensor.numel() == 1:
            flags.append((float(tensor.item()), str(op), tensor))
        return saved(tensor, op, *args, **kwargs)

    dist.all_reduce = logged
    try:
        join = Join([ddp])
        join.__enter__()
        for _ in range(3 if rank == 0 else 1):
            ddp(torch.randn(2, 4)).sum().backward()
        with _profiled() as p:
            join.__exit__(None, None, None)
    finally:
        dist.all_reduce = saved
    return dict(flags=[(put, op, float(t.item())) for put, op, t in flags], exit_ops=dict(p.ops),
                weight=ddp.module.weight.detach().clone())


def _powersgd_probe(rank):
    """torch DDP with torch's PowerSGD hook compressing from the third step: the dtypes of the
    all-reduces its third step issues."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(64, 64, bias=False))
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for step in range(3):
        with _recording("all_reduce") as calls:
            ddp(torch.randn(4, 64)).sum().backward()
    return calls


def _ddp_takes(name: str) -> bool:
    """Whether this torch's DDP takes the keyword ``name`` (some are new in torch 2.13)."""
    return name in inspect.signature(DDP.__init__).parameters


def _four_linears():
    """Four Linear(32, 32) layers: one bucket each under _SMALL_CAP_MB, after the rebuild."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


# 2097 bytes: a Linear(32, 32)'s weight (4096 bytes) closes a bucket by itself, with its bias.
_SMALL_CAP_MB = 0.002


def _bucket_log_probe(rank):
    """torch DDP with small buckets, a comm hook that logs each bucket it is handed before
    all-reducing it as the default does, and a post-accumulate-grad hook on the first layer's
    weight: in what order the two run in each backward, and what the bucket holds meanwhile."""
    model = _four_linears()
    ddp = DDP(model, bucket_cap_mb=_SMALL_CAP_MB)
    events = []

    def logging_hook(state, bucket):
        buf = bucket.buffer()
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        views = bucket.gradients()
        events.append(dict(
            kind="bucket", index=bucket.index(), buffer=buf.data_ptr(),
            storage=buf.untyped_storage().data_ptr(),
            views_in_buffer=all(
                g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                and start <= g.data_ptr() < end for g in views),
            holds_grads=all(torch.equal(g, p.grad) for g, p in zip(views, bucket.parameters()))))
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, logging_hook)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: events.append(dict(kind="layer0")))
    steps = []
    for step in range(3):
        events.clear()
        ddp.zero_grad()
        ddp(torch.randn(4, 32)).sum().backward()
        bucket_storages = {e["storage"] for e in events if e["kind"] == "bucket"}
        grads_apart = all(p.grad.untyped_storage().data_ptr() not in bucket_storages
                          for p in model.parameters())
        steps.append(dict(events=list(events), grads_apart=grads_apart))
    return steps


def _no_sync_buckets_probe(rank):
    """The same small-bucket model under torch DDP without a hook: the all-reduces of three
    plain steps, then of three micro-steps, the first two under no_sync()."""
    ddp = DDP(_four_linears(), bucket_cap_mb=_SMALL_CAP_MB)
    plain, acc = [], []
    for step in range(3):
        ddp.zero_grad()
        out = ddp(torch.randn(4, 32)).sum()
        with _profiled() as p:
            out.backward()
        plain.append(p.ops.get("all_reduce", 0))
    ddp.zero_grad()
    for k in range(3):
        with ddp.no_sync() if k < 2 else torch.enable_grad():
            out = ddp(torch.randn(4, 32)).sum()
            with _profiled() as p:
                out.backward()
        acc.append(p.ops.get("all_reduce", 0))
    return dict(plain=plain, acc=acc)


def _grad_copy_ops_probe(rank):
    """aten ops that copy or scale gradients in a backward of torch DDP on the rebuilt buckets,
    with batched_grad_copy left at its default and set to True."""
    if not _ddp_takes("batched_grad_copy"):
        return None
    out = {}
    for batched in (False, True):
        ddp = DDP(_four_linears(), bucket_cap_mb=_SMALL_CAP_MB, batched_grad_copy=batched)
        for step in range(2):  # the second step runs on the rebuilt buckets
            ddp.zero_grad()
            y = ddp(torch.randn(4, 32)).sum()
            with torch.autograd.profiler.profile(use_kineto=False) as prof:
                y.backward()
        names = [e.name for e in prof.function_events]
        out[batched] = {op: names.count(op) for op in
                        ("aten::mul", "aten::div", "aten::div_", "aten::_foreach_copy_")}
    out["params"] = len(list(ddp.parameters()))
    return out


def _autocast_probe(rank):
    """torch DDP's forward and backward under CPU autocast to bfloat16: the dtype of the output,
    of each bucket the comm hook is handed, of the tensors all-reduced, and of the gradients."""
    ddp = DDP(_four_linears(), bucket_cap_mb=_SMALL_CAP_MB)
    seen = []

    def dtype_hook(state, bucket):
        seen.append(bucket.buffer().dtype)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, dtype_hook)
    out = []
    for step in range(2):  # the second step runs on the rebuilt buckets
        seen.clear()
        ddp.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ddp(torch.randn(4, 32))
        with _recording("all_reduce") as calls:
            y.float().sum().backward()
        out.append(dict(output=y.dtype, buckets=list(seen), wire=[c[1] for c in calls],
                        grads={p.grad.dtype for p in ddp.module.parameters()}))
    return out


def _buffer_flags_probe(rank):
    """BatchNorm whose running_mean differs per rank before DDP is built, wrapped with
    forward_sync_buffers=False or with the deprecated broadcast_buffers=False: the warnings,
    the running_mean right after construction, and the broadcasts of the first forward."""
    if not _ddp_takes("forward_sync_buffers"):
        return None
    out = {}
    for name in ("forward_sync_buffers", "broadcast_buffers"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        with torch.no_grad():
            net[1].running_mean.fill_(float(rank + 1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(net, **{name: False})
        after_init = net[1].running_mean.clone()
        with _profiled() as p:
            ddp(torch.randn(8, 4))
        out[name] = dict(
            future_warnings=[str(w.message) for w in caught
                             if issubclass(w.category, FutureWarning)],
            after_init=after_init.tolist(), forward_broadcasts=p.ops.get("broadcast", 0))
    return out


def _bf16_name_probe(rank):
    """What torch DDP's register_comm_hook does with torch's bf16_compress_hook, with a plain
    all-reduce hook renamed bf16_compress_hook, and with bf16_compress_hook wrapped under
    another name (the last then runs one step)."""

    def outcome(hook):
        ddp = DDP(_four_linears())
        try:
            ddp.register_comm_hook(None, hook)
        except TypeError as err:
            return ddp, f"refused: {err}"
        return ddp, "accepted"

    def renamed(state, bucket):
        return default_hooks.allreduce_hook(state, bucket)

    renamed.__name__ = "bf16_compress_hook"

    def wrapped(state, bucket):
        return default_hooks.bf16_compress_hook(state, bucket)

    out = dict(real=outcome(default_hooks.bf16_compress_hook)[1], renamed=outcome(renamed)[1])
    ddp, out["wrapped"] = outcome(wrapped)
    with _recording("all_reduce") as calls:
        ddp(torch.randn(4, 32)).sum().backward()
    out.update(wire={c[1] for c in calls}, grads={p.grad.dtype for p in ddp.module.parameters()})
    return out


def _probes(rank_arg=None):
    rank = dist.get_rank()
    return dict(order=_order_probe(rank), completion=_completion_probe(rank),
                threads=_threads_probe(rank), ddp_sync=_ddp_sync_probe(rank),
                hook_order=_hook_order_probe(rank), join=_join_probe(rank),
                powersgd=_powersgd_probe(rank), bucket_log=_bucket_log_probe(rank),
                no_sync_buckets=_no_sync_buckets_probe(rank), autocast=_autocast_probe(rank),
                buffer_flags=_buffer_flags_probe(rank), bf16_name=_bf16_name_probe(rank),
                grad_copy_ops=_grad_copy_ops_probe(rank))


@pytest.fixture(scope="module")
def ranks():
    return dpcourse.run(_probes, world_size=2, backend="gloo", device="cpu", timeout=240)


# --------------------------------------------------------------------------- lesson 06


def test_collectives_are_matched_by_issue_order_not_by_tensor(ranks):
    """Lesson 06 (from a hook to an all-reduce): ranks match collectives by the order they issue
    them: rank 0's first all-reduce is summed with rank 1's first, whatever tensor each passed."""
    assert ranks[0]["order"] == [1.0 + 20.0, 10.0 + 2.0]
    assert ranks[1]["order"] == [21.0, 12.0]


def test_all_reduce_is_not_complete_until_every_rank_has_issued_it(ranks):
    """Lessons 06 and 09: a collective finishes only once every rank has joined it: rank 0's
    async all-reduce stays incomplete while rank 1 has not issued its own, and completes with
    the sum once it has."""
    r0 = ranks[0]["completion"]
    assert r0["completed_before_peer"] is False
    assert r0["completed_after"] is True and r0["value"] == [3.0] * 4
    assert ranks[1]["completion"]["value"] == [3.0] * 4


def test_ddp_hands_a_bucket_over_for_all_reduce_while_backward_still_runs(ranks):
    """Lesson 06, introduction: torch DDP sends a bucket while backward is still running. From
    the second step on (after the rebuild), with one bucket per layer, the comm hook gets the
    first bucket (the last layer's gradients) before the first layer's weight has its gradient;
    in the first step, one bucket for all, it comes only after."""
    for r in ranks:
        steps = [[e.get("index", e["kind"]) for e in s["events"]] for s in r["bucket_log"]]
        assert steps[0] == ["layer0", 0]
        for order in steps[1:]:
            assert order == [0, 1, 2, "layer0", 3]


def test_ddp_copies_each_gradient_into_a_preallocated_bucket(ranks):
    """Lesson 06, "Gradients into a flat buffer and back": with gradient_as_bucket_view=False,
    the bucket the reducer hands over holds a copy of each of its parameters' gradients, in a
    flat buffer allocated once (the same memory in steps 2 and 3, after the rebuild) that no
    param.grad shares."""
    for r in ranks:
        steps = r["bucket_log"]
        buffers = [[e["buffer"] for e in s["events"] if e["kind"] == "bucket"] for s in steps]
        assert len(buffers[1]) == 4 and buffers[1] == buffers[2]
        for s in steps:
            assert all(e["holds_grads"] for e in s["events"] if e["kind"] == "bucket")
            assert s["grads_apart"]


def test_batched_grad_copy_is_off_by_default_and_copies_a_bucket_at_once(ranks):
    """Lesson 06, "From a hook to an all-reduce in flight": torch 2.13's batched_grad_copy is
    False by default, and then the reducer runs one aten::mul per parameter (the gradient times
    1/world size into its bucket) and no division; with batched_grad_copy=True it runs instead
    one _foreach_copy_ and one div_ per bucket (four Linear layers: 8 parameters, 4 buckets)."""
    if not _ddp_takes("batched_grad_copy"):
        pytest.skip("a statement about torch 2.13: this torch's DDP has no batched_grad_copy")
    assert inspect.signature(DDP.__init__).parameters["batched_grad_copy"].default is False
    for r in ranks:
        ops = r["grad_copy_ops"]
        assert ops["params"] == 8
        assert ops[False] == {"aten::mul": 8, "aten::div": 0, "aten::div_": 0,
                              "aten::_foreach_copy_": 0}
        assert ops[True] == {"aten::mul": 0, "aten::div": 0, "aten::div_": 4,
                             "aten::_foreach_copy_": 4}


def test_gloo_completes_an_async_all_reduce_on_its_own_threads(ranks):
    """Lessons 06 and 08: over gloo an async all-reduce is processor work done by gloo's own
    threads: it completes, sum in place, while the thread that issued it only sleeps and never
    calls wait()."""
    for r in ranks:
        assert r["threads"] == dict(completed_without_wait=True, summed_without_wait=True)


# --------------------------------------------------------------------------- lesson 07


def test_ddp_averages_at_the_end_of_backward_and_once_after_no_sync(ranks):
    """Lesson 07: torch DDP averages the gradients over the ranks by itself during every backward
    run outside no_sync() (no further call needed); backwards under no_sync() issue no
    all-reduce, and the first backward outside it averages the accumulated sum with one
    all-reduce per bucket: one for a one-bucket Linear, four for four Linear layers in buckets
    of their own (after the first step, which runs as one bucket)."""
    for r in ranks:
        d = r["ddp_sync"]
        assert d["plain_mean"] == [True, True]
        assert [o.get("all_reduce", 0) for o in d["plain_ops"]] == [1, 1]
        assert [o.get("all_reduce", 0) for o in d["acc_ops"]] == [0, 0, 1]
        assert d["acc_mean"] is True
        n_buckets = len([e for e in r["bucket_log"][1]["events"] if e["kind"] == "bucket"])
        assert n_buckets == 4
        assert r["no_sync_buckets"] == dict(plain=[1, n_buckets, n_buckets], acc=[0, 0, n_buckets])


# --------------------------------------------------------------------------- lesson 08


def test_a_fresh_adamw_starts_its_moments_at_zero_and_its_step_at_one():
    """Lesson 08 (resume): an AdamW built afresh holds no state; its first step counts as step 1
    and starts both moments from zero (exp_avg = (1 - beta1) g, exp_avg_sq = (1 - beta2) g^2), so
    it moves the weight by lr (to eps) whatever moments an earlier run had built."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.999), weight_decay=0.0)
    assert len(opt.state) == 0
    g = torch.tensor([0.5, 4.0])
    p.grad = g.clone()
    opt.step()
    state = opt.state[p]
    assert float(state["step"]) == 1.0
    assert torch.allclose(state["exp_avg"], 0.1 * g)
    assert torch.allclose(state["exp_avg_sq"], 0.001 * g * g)
    # bias correction of step 1 undoes the (1 - beta) factors: the step is lr * sign(g)
    assert torch.allclose(p.detach(), torch.tensor([1.0 - 0.1, -2.0 - 0.1]), atol=1e-6)


# --------------------------------------------------------------------------- lesson 09


def test_ddp_under_autocast_all_reduces_float32_buckets(ranks):
    """Lesson 09 (bf16 mixed precision): under torch.autocast to bfloat16, torch DDP's forward
    computes in bfloat16, but the buckets its reducer hands to the comm hook, the all-reduces,
    and the gradients are float32."""
    for r in ranks:
        for step in r["autocast"]:
            assert step["output"] == torch.bfloat16
            assert step["buckets"] and set(step["buckets"]) == {torch.float32}
            assert step["wire"] == step["buckets"]  # one float32 all-reduce per bucket
            assert step["grads"] == {torch.float32}


# --------------------------------------------------------------------------- lesson 10


def test_join_flags_say_who_still_trains_and_the_last_joiner_is_copied(ranks):
    """Lesson 10, section 2: under Join every step begins with one-element all-reduces to which a
    rank still training adds 1 and a joined rank adds 0, so the joined rank learns that others
    still train (a sum of 1); at the end the ranks agree, with a MAX all-reduce, on the last
    rank to finish (rank 0 here puts its rank in, the other -1) and its parameters are
    broadcast to all."""
    longer, joined = (r["join"] for r in ranks)
    sums = [f for f in longer["flags"] if "MAX" not in f[1]]
    # rank 0 trained every step: it put in 1 for every flag of its three steps
    training = sums[:-1]
    assert training and all(put == 1.0 for put, _, _ in training)
    # rank 1 trained one step, then shadowed: its flags after that step put in 0 and read 1
    j_sums = [f for f in joined["flags"] if "MAX" not in f[1]]
    first_step = len(training) // 3
    shadow = j_sums[first_step:-1]
    assert shadow and all(put == 0.0 and got == 1.0 for put, _, got in shadow)
    assert all(put == 1.0 for put, _, _ in j_sums[:first_step])
    # the final round finds nobody still training
    assert longer["flags"][-2][::2] == joined["flags"][-2][::2] == (0.0, 0.0)
    # agreement on the last joiner: MAX of (0, -1) = rank 0
    assert [(p, g) for p, op, g in longer["flags"] if "MAX" in op] == [(0.0, 0.0)]
    assert [(p, g) for p, op, g in joined["flags"] if "MAX" in op] == [(-1.0, 0.0)]
    assert longer["exit_ops"].get("broadcast", 0) >= 1
    assert torch.equal(longer["weight"], joined["weight"])


def test_batchnorm_statistics_are_buffers_and_training_uses_the_batchs_own():
    """Lesson 10, section 3: BatchNorm's running mean and variance are buffers, not parameters,
    and take no gradient; in training mode it normalises with the statistics of the batch it
    is given (biased variance) and updates the running averages, which evaluation mode uses."""
    norm = torch.nn.BatchNorm1d(3)
    assert [n for n, _ in norm.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in norm.named_buffers()] == ["running_mean", "running_var",
                                                    "num_batches_tracked"]
    assert not any(b.requires_grad for b in norm.buffers())
    x = torch.randn(8, 3) * 3 + 5
    y = norm(x)
    expected = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + norm.eps)
    assert torch.allclose(y, expected, atol=1e-5)
    assert torch.allclose(norm.running_mean, 0.1 * x.mean(0), atol=1e-6)
    norm.eval()
    want = (x - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
    assert torch.allclose(norm(x), want, atol=1e-5)


def test_forward_sync_buffers_off_still_copies_buffers_at_construction(ranks):
    """Lesson 10, section 3: torch 2.13 turns off the copy of rank 0's buffers before every
    forward with forward_sync_buffers=False; broadcast_buffers=False, the older name, does too,
    with a FutureWarning that it is deprecated, and also skips the copy at construction, which
    forward_sync_buffers=False still makes."""
    if not _ddp_takes("forward_sync_buffers"):
        pytest.skip("a statement about torch 2.13: this torch's DDP has no forward_sync_buffers")
    for rank, r in enumerate(ranks):
        new, old = r["buffer_flags"]["forward_sync_buffers"], r["buffer_flags"]["broadcast_buffers"]
        assert new["future_warnings"] == []
        assert len(old["future_warnings"]) == 1 and "deprecated" in old["future_warnings"][0]
        assert new["after_init"] == [1.0] * 4                 # rank 0's value, on every rank
        assert old["after_init"] == [float(rank + 1)] * 4     # each rank's own
        assert new["forward_broadcasts"] == old["forward_broadcasts"] == 0


# --------------------------------------------------------------------------- lesson 11


def test_16_bit_hooks_cast_to_16_bits_then_divide_in_16_bits(ranks):
    """Lesson 11, section 1: torch's fp16 and bf16 compress hooks first cast the float32 bucket
    to float16 / bfloat16, then divide that 16-bit copy by the world size, then all-reduce it:
    a gradient too large for float16 (70000, half of which would fit) reaches the sum as inf."""
    for r in ranks:
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            ops = r["hook_order"][name]
            cast = next(i for i, op in enumerate(ops) if op[2] == dtype)
            div = next(i for i, op in enumerate(ops) if op[0].startswith("div"))
            assert ops[cast][1] == [torch.float32]  # the cast reads the float32 bucket
            assert cast < div and ops[div][1][0] == dtype  # the division runs in 16 bits
            reduce = next(i for i, op in enumerate(ops) if "allreduce" in op[0])
            assert div < reduce
        assert r["hook_order"]["overflow"] == float("inf")


def test_powersgd_all_reduces_its_factors_in_float32(ranks):
    """Exercise 11: once it compresses, torch's PowerSGD hook all-reduces its low-rank factors
    in float32 (the dtype of the float32 gradients it compresses), not in 16 bits."""
    for r in ranks:
        calls = r["powersgd"]
        assert calls and {dtype for _, dtype, _ in calls} == {torch.float32}
        assert all(numel < 64 * 64 for _, _, numel in calls)  # factors, not the full matrix


def test_comm_hook_bucket_gradients_are_views_into_its_buffer(ranks):
    """Lesson 11, section 1: the tensors a bucket's gradients() returns are views into its
    buffer(): each lies in the buffer's storage, inside the buffer's bytes."""
    for r in ranks:
        events = [e for s in r["bucket_log"] for e in s["events"] if e["kind"] == "bucket"]
        assert len(events) == 9 and all(e["views_in_buffer"] for e in events)


def test_ddp_checks_the_bf16_hook_by_its_name(ranks):
    """Lesson 11, section 1: register_comm_hook refuses a hook whose __name__ is
    bf16_compress_hook unless torch has CUDA or HIP with NCCL 2.10+, or XPU with XCCL: it
    judges by the name, so a plain all-reduce hook given that name is treated the same, and
    bf16_compress_hook wrapped in a function of another name registers and runs on gloo,
    sending bfloat16 and leaving float32 gradients."""
    cuda_nccl = ((torch.version.cuda is not None or torch.version.hip is not None)
                 and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10))
    xccl = hasattr(dist, "is_xccl_available") and dist.is_xccl_available()
    for r in ranks:
        d = r["bf16_name"]
        assert d["renamed"] == d["real"]
        if not (cuda_nccl or xccl):
            assert d["real"].startswith("refused:") and "BF16" in d["real"]
        assert d["wrapped"] == "accepted"
        assert d["wire"] == {torch.bfloat16} and d["grads"] == {torch.float32}
