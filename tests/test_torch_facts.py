"""What the lessons say about torch, NCCL and gloo, asked of torch itself.

Every sentence of a lesson about what torch does names a test here. The tests
ask torch, never dpcourse: they run torch DDP, torch's hooks, torch's Join and
torch's SyncBatchNorm function on 2 CPU ranks over gloo, and count the collectives
torch issues with ``torch.profiler`` (its ``c10d::`` operator events, which record
the collectives of torch's C++ reducer too) or by recording the calls torch makes
into ``torch.distributed``. Facts that need NCCL are marked ``gpu``.

The 2-rank probes of lessons 10 and 11 run in one launch (a module fixture), so the
file stays fast on a small CPU machine; each test then checks one statement. The
sections for lessons 00-09 and 12-14 follow, each test naming the lesson cell it backs.
"""

from __future__ import annotations

import copy
import inspect
import io
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dpcourse

MiB = 2**20


# --------------------------------------------------------------------------- helpers


def _mlp(seed=0, widths=(8, 32, 32, 1)):
    """A plain Linear/tanh stack with fixed weights (torch modules only)."""
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


class _Unused(torch.nn.Module):
    """An MLP with a layer its forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.unused, self.fc2 = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                           torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class _Buffered(torch.nn.Module):
    """Linear then BatchNorm1d: three buffers (running_mean, running_var, num_batches_tracked)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.norm = torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.fc(x))


def _c10d_ops(prof) -> Counter:
    """Collectives torch issued inside a profiler context, by kind (c10d operator events)."""
    kinds = Counter()
    for e in prof.function_events:
        if not e.name.startswith("c10d::"):
            continue
        name = e.name[len("c10d::"):]
        if "allreduce" in name:
            kinds["all_reduce"] += 1
        elif "broadcast" in name:
            kinds["broadcast"] += 1
        elif "allgather" in name:
            kinds["all_gather"] += 1
        elif "barrier" not in name:
            kinds[name] += 1
    return kinds


@contextmanager
def _profiled():
    """Profile the CPU side; ``yield`` a holder whose ``ops`` is the c10d count afterwards.

    The autograd profiler without Kineto: it records the same operator events, and starts in
    milliseconds where Kineto's first start takes seconds.
    """
    holder = type("Ops", (), {})()
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        yield holder
    holder.ops = _c10d_ops(prof)


@contextmanager
def _recording(*names):
    """Record the outermost calls torch makes to ``torch.distributed.<name>``.

    Yields the list of calls as ``(name, dtype, numel)`` of the tensor sent.
    """
    calls, depth, saved = [], [0], {}

    def sent(name, args, kwargs):
        # all_gather(outs, tensor), all_gather_into_tensor(out, tensor) and the reduce-scatters
        # (output, input) send their second argument; the others their first
        second = name.startswith(("all_gather", "_all_gather", "reduce_scatter"))
        keys = ("input", "input_tensor", "tensor", "input_list") if second else ("tensor",)
        t = args[1] if second and len(args) > 1 else args[0] if not second and args else next(
            kwargs[k] for k in keys if k in kwargs)
        return t[0] if isinstance(t, (list, tuple)) else t

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            if depth[0] == 0:
                t = sent(name, args, kwargs)
                calls.append((name, t.dtype, t.numel()))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return recorded

    for name in names:
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, saved[name]))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _counting_hook(log):
    """A comm hook that logs each bucket (index, parameters, bytes, all zeros?) and all-reduces."""
    def hook(state, bucket):
        buf = bucket.buffer()
        log.append(dict(index=bucket.index(), ids=[id(p) for p in bucket.parameters()],
                        nbytes=buf.numel() * buf.element_size(), zero=bool((buf == 0).all()),
                        storage=buf.untyped_storage().data_ptr()))
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def _defaults(fn) -> dict:
    """Parameter name -> default value of ``fn``."""
    return {k: v.default for k, v in inspect.signature(fn).parameters.items()}


def _step(model, x, y=None):
    out = model(x)
    loss = out.sum() if y is None else F.mse_loss(out, y)
    loss.backward()


def _data(step, n=4, dim=8):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g)


# ------------------------------------------------------------- probes run on each rank


def _probe_buckets():
    """Buckets per step (from a counting hook) and collectives per step, for DDP options."""
    out = {}
    configs = {"default": {}, "cap": dict(bucket_cap_mb=0.002),
               "find_unused": dict(bucket_cap_mb=0.002, find_unused_parameters=True),
               "static": dict(bucket_cap_mb=0.002, static_graph=True)}
    for name, kw in configs.items():
        model = DDP(_mlp(), **kw)
        index = {id(p): i for i, p in enumerate(model.module.parameters())}
        log = []
        model.register_comm_hook(None, _counting_hook(log))
        steps = []
        for step in range(3):
            log.clear()
            with _profiled() as p:
                _step(model, *_data(step))
            steps.append(dict(buckets=len(log), ops=dict(p.ops),
                              params=[sorted(index[i] for i in b["ids"]) for b in log]))
        out[name] = steps
    out["n_params"] = len(list(_mlp().parameters()))
    return out


def _probe_first_bucket():
    """Default bucket_cap_mb on a 2 MiB model: bucket sizes in steps 1 and 2."""
    model = DDP(_mlp(widths=(256,) * 9))  # 8 Linear(256, 256): about 2 MiB of fp32 gradients
    log = []
    model.register_comm_hook(None, _counting_hook(log))
    sizes = []
    for step in range(2):
        log.clear()
        _step(model, torch.randn(2, 256))
        sizes.append([b["nbytes"] for b in log])
    layer = max(p.numel() * p.element_size() for p in model.parameters())
    return dict(sizes=sizes, total=sum(p.numel() * 4 for p in model.parameters()), layer=layer,
                cap=model.bucket_bytes_cap)


def _probe_hooks():
    """Bucket API, the future's value, the default mean, and the 16-bit hooks' wire dtype."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    x, y = _data(0)
    local = _mlp()
    _step(local, x, y)
    mine = torch.cat([p.grad.flatten() for p in local.parameters()])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    out["local_grads"] = every

    # the default (no hook): the mean of the ranks' gradients
    model = DDP(_mlp())
    _step(model, x, y)
    out["default"] = torch.cat([p.grad.flatten() for p in model.parameters()])

    # a hook's future value is what lands in the gradients; the bucket's methods
    api = {}

    def seven(state, bucket):
        buf = bucket.buffer()
        api.update(buffer_is_1d=buf.dim() == 1, index=type(bucket.index()).__name__,
                   is_last=type(bucket.is_last()).__name__,
                   grads_match_params=len(bucket.gradients()) == len(bucket.parameters()),
                   grads_sum_to_buffer=sum(g.numel() for g in bucket.gradients()) == buf.numel())
        fut = torch.futures.Future()
        fut.set_result(torch.full_like(buf, 7.0))
        return fut
    model = DDP(_mlp())
    model.register_comm_hook(None, seven)
    _step(model, x, y)
    out["api"] = api
    out["seven"] = all(bool((p.grad == 7).all()) for p in model.parameters())

    # 16-bit hooks: what dtype crosses the wire, and what comes back
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        fn = getattr(default_hooks, f"{name}_compress_hook")

        def call(state, bucket, fn=fn):  # a wrapper: DDP checks the bf16 hook by its name
            return fn(state, bucket)
        model = DDP(_mlp())
        model.register_comm_hook(None, call)
        with _recording("all_reduce") as calls:
            _step(model, x, y)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        sent = [(e / world).to(dtype) for e in every]
        expect = sent[0]
        for s in sent[1:]:
            expect = expect + s  # the sum in the wire dtype, as the backend adds
        out[name] = dict(wire=[c[1] for c in calls], wire_numel=sum(c[2] for c in calls),
                         result_dtype=got.dtype, exact=torch.equal(got, expect.float()),
                         numel=mine.numel())
    # torch DDP's check of the bf16 hook at registration
    try:
        DDP(_mlp()).register_comm_hook(None, default_hooks.bf16_compress_hook)
        out["bf16_register"] = "accepted"
    except TypeError as err:
        out["bf16_register"] = str(err)
    return out


def _probe_powersgd():
    """Elements all-reduced per step by torch's PowerSGD hook, before and after its start."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    model = DDP(net)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    per_step = []
    for step in range(4):
        with _recording("all_reduce") as calls:
            _step(model, torch.randn(4, 32))
        per_step.append(sum(c[2] for c in calls))
    shapes = [tuple(p.shape) for p in net.parameters()]
    residuals = {i: (e.numel(), e.norm().item()) for i, e in state.error_dict.items()}
    # the same without error feedback: no residual is kept
    plain = DDP(copy.deepcopy(net))
    off = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                      use_error_feedback=False)
    plain.register_comm_hook(off, powerSGD_hook.powerSGD_hook)
    for step in range(4):
        _step(plain, torch.randn(4, 32))
    return dict(per_step=per_step, shapes=shapes, residuals=residuals,
                residuals_off=len(off.error_dict))


def _probe_view():
    """Does param.grad share storage with the bucket, with and without gradient_as_bucket_view?"""
    out = {}
    for view in (True, False):
        model = DDP(_mlp(), gradient_as_bucket_view=view)
        log = []
        model.register_comm_hook(None, _counting_hook(log))
        for step in range(2):  # the second step: after the rebuild
            log.clear()
            model.zero_grad(set_to_none=False)
            _step(model, *_data(step))
        storages = {b["storage"] for b in log}
        out[view] = [p.grad.untyped_storage().data_ptr() in storages for p in model.parameters()]
    return out


def _probe_unused():
    """torch DDP with a parameter the forward never uses, under each option."""
    out = {}
    for name, kw in (("find_unused", dict(find_unused_parameters=True)),
                     ("static", dict(static_graph=True))):
        model = DDP(_Unused(), bucket_cap_mb=0.0005, **kw)
        log = []
        model.register_comm_hook(None, _counting_hook(log))
        extra = []
        for step in range(3):
            log.clear()
            with _profiled() as p:
                _step(model, *_data(step))
            extra.append(p.ops["all_reduce"] - len(log))  # all-reduces beyond the buckets'
        out[name] = dict(extra=extra, grads=[n for n, q in model.module.named_parameters()
                                             if q.grad is None])
    model = DDP(_Unused())
    _step(model, *_data(0))
    try:
        _step(model, *_data(1))
        out["default"] = "no error"
    except RuntimeError as err:
        out["default"] = str(err)
    return out


def _probe_buffers():
    """broadcast_buffers: the buffer values the forward sees, and the broadcasts that carry them."""
    rank = dist.get_rank()
    out = {}
    for name, kw in (("default", {}), ("off", dict(broadcast_buffers=False))):
        model = DDP(_Buffered(), **kw)
        with torch.no_grad():
            model.module.norm.running_mean.fill_(float(rank + 1))  # ranks now disagree
        seen = []
        model.module.norm.register_forward_pre_hook(
            lambda m, inp: seen.append(m.running_mean.clone()))
        with _profiled() as p:
            model(torch.randn(4, 8))
        out[name] = dict(ops=dict(p.ops), seen=seen[0])
    out.update(buffers=[n for n, _ in model.module.named_buffers()],
               dtypes=len({b.dtype for b in model.module.buffers()}),
               prefixed=all(k.startswith("module.") for k in model.state_dict()))
    return out


def _probe_join():
    """torch DDP under Join with uneven batch counts: collectives, zeros, divisor, final copy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [3, 1]
    out = {}
    model = DDP(_mlp(), bucket_cap_mb=0.002)
    log = []
    model.register_comm_hook(None, _counting_hook(log))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _profiled() as p, Join([model]):
        for step in range(counts[rank]):
            _step(model, *_data(step))
            opt.step()
            opt.zero_grad()
    params = torch.cat([q.detach().flatten() for q in model.parameters()])
    every = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(every, params)
    out["ops"] = dict(p.ops)
    out["hook_calls"] = len(log)
    out["zero_buckets"] = sum(b["zero"] for b in log)
    out["buckets"] = len({b["index"] for b in log})
    out["equal_params"] = all(torch.equal(e, every[0]) for e in every)
    # the divisor while rank 1 has joined: rank 0's gradient / 2 (default) or / 1
    for divide in (True, False):
        model = DDP(_mlp())
        with Join([model], divide_by_initial_world_size=divide):
            for step in range(counts[rank]):
                x, y = _data(step)
                if rank == 0 and step == 1:
                    local = copy.deepcopy(model.module)
                    _step(local, x, y)
                    alone = torch.cat([q.grad.flatten() for q in local.parameters()])
                model.zero_grad()
                _step(model, x, y)
                if rank == 0 and step == 1:
                    got = torch.cat([q.grad.flatten() for q in model.parameters()])
                    out[f"divide_{divide}"] = (got / alone).median().item()
    return out


def _probe_hang():
    """torch DDP with one rank a batch short: the other waits in its all-reduce until timeout."""
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    model = DDP(_mlp(), process_group=group)
    result = dict(error=None, waited=0.0)
    for step in range(2 - rank):  # rank 0: 2 batches, rank 1: 1
        t0 = time.perf_counter()
        try:
            _step(model, *_data(step))
        except RuntimeError as err:
            result.update(error=type(err).__name__ + ": " + str(err).splitlines()[0],
                          waited=time.perf_counter() - t0)
            break
    dist.barrier()  # the default group still works: rank 1 waits here for rank 0's timeout
    return result


# ---------------------------------------------------------------- SyncBatchNorm on CPU
# torch's SyncBatchNorm autograd function needs five statistics kernels that exist only for
# GPUs. These CPU equivalents let torch's own function run over gloo, so its collectives can
# be observed; the test compares the result with one process on the global batch, which
# checks the kernels and torch's protocol together.


def _flat(t):
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _bshape(t, x):
    return t.view((1, -1) + (1,) * (x.dim() - 2))


def _cpu_stats(x, eps):
    f = _flat(x)
    return f.mean(1), 1 / torch.sqrt(f.var(1, unbiased=False) + eps)


def _cpu_gather(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    n = counts.view(-1, 1)
    total = n.sum()
    mean = (mean_all * n).sum(0) / total
    var = ((1 / invstd_all**2 - eps + (mean_all - mean) ** 2) * n).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(momentum * mean)
        running_var.mul_(1 - momentum).add_(momentum * var * total / (total - 1))
    return mean, 1 / torch.sqrt(var + eps)


def _cpu_elemt(x, weight, bias, mean, invstd, eps):
    y = (x - _bshape(mean, x)) * _bshape(invstd, x)
    return y if weight is None else y * _bshape(weight, x) + _bshape(bias, x)


def _cpu_backward_reduce(dy, x, mean, invstd, weight, need_input, need_weight, need_bias):
    fdy, xmu = _flat(dy), _flat(x) - mean[:, None]
    sum_dy, sum_dy_xmu = fdy.sum(1), (fdy * xmu).sum(1)
    grad_weight = sum_dy_xmu * invstd if need_weight else None
    return sum_dy, sum_dy_xmu, grad_weight, sum_dy if need_bias else None


def _cpu_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    total = count.sum()
    xmu = x - _bshape(mean, x)
    inv = _bshape(invstd, x)
    grad = dy - _bshape(sum_dy / total, x) - xmu * inv**2 * _bshape(sum_dy_xmu / total, x)
    return grad * inv * (1 if weight is None else _bshape(weight, x))


_CPU_KERNELS = dict(batch_norm_stats=_cpu_stats, batch_norm_gather_stats_with_counts=_cpu_gather,
                    batch_norm_elemt=_cpu_elemt, batch_norm_backward_reduce=_cpu_backward_reduce,
                    batch_norm_backward_elemt=_cpu_backward_elemt)


@contextmanager
def _cpu_batchnorm_kernels():
    saved = {k: getattr(torch, k) for k in _CPU_KERNELS}
    for k, fn in _CPU_KERNELS.items():
        setattr(torch, k, fn)
    try:
        yield
    finally:
        for k, fn in saved.items():
            setattr(torch, k, fn)


_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base")


def _sync_bn_collectives(device):
    """Run torch's SyncBatchNorm function on this rank's shard; record its collectives."""
    from torch.nn.modules._functions import SyncBatchNorm as SyncBatchNormFunction

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * world, 3, generator=g) * torch.tensor([1.0, 2.0, 3.0]) + 1
    weight = torch.tensor([1.0, 0.5, 2.0], device=device, requires_grad=True)
    bias = torch.tensor([0.0, 1.0, -1.0], device=device, requires_grad=True)
    mine = x[rank * 8:(rank + 1) * 8].to(device).requires_grad_()
    running_mean, running_var = torch.zeros(3, device=device), torch.ones(3, device=device)
    with _recording(*_GATHERS) as forward_calls:
        y = SyncBatchNormFunction.apply(mine, weight, bias, running_mean, running_var, 1e-5, 0.1,
                                        dist.group.WORLD, world)
    with _recording("all_reduce") as backward_calls:
        (y * torch.arange(1.0, 4.0, device=device)).sum().backward()
    ref = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    xr = x.clone().requires_grad_()
    (ref(xr) * torch.arange(1.0, 4.0)).sum().backward()
    own = slice(rank * 8, (rank + 1) * 8)
    return dict(forward=forward_calls, backward=backward_calls,
                output_error=(y.detach().cpu() - _global_bn(x, ref)[own]).abs().max().item(),
                running_error=max((running_mean.cpu() - ref.running_mean).abs().max().item(),
                                  (running_var.cpu() - ref.running_var).abs().max().item()),
                grad_error=(mine.grad.cpu() - xr.grad[own]).abs().max().item())


def _global_bn(x, ref):
    """The training-mode output of ``ref`` on the global batch, without touching its buffers."""
    return F.batch_norm(x, None, None, ref.weight.detach(), ref.bias.detach(), True, 0.0, ref.eps)


def _probe_sync_batchnorm():
    out = {}
    try:
        torch.nn.SyncBatchNorm(3)(torch.randn(4, 3))
        out["module_on_cpu"] = "ran"
    except ValueError as err:
        out["module_on_cpu"] = str(err)
    with _cpu_batchnorm_kernels():
        out.update(_sync_bn_collectives("cpu"))
    return out


def _probe_fsdp_reduce_dtype():
    """fully_shard with reduce_dtype=bf16: the dtype reduce-scattered, and the gradients' dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.bfloat16))
    with _recording("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter") as calls:
        net(torch.randn(4, 8)).float().sum().backward()
    return dict(wire=[c[1] for c in calls], grads={p.grad.dtype for p in net.parameters()})


def _first_update(opt_cls, scale, **kw):
    torch.manual_seed(0)
    model = _mlp()
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    (scale * F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1))).backward()
    opt.step()
    return (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm().item()


def _probe_optimizers():
    """Step size with the loss 4x too large / with the correct loss, for SGD and AdamW."""
    return {"SGD": _first_update(torch.optim.SGD, 4.0) / _first_update(torch.optim.SGD, 1.0),
            "AdamW": (_first_update(torch.optim.AdamW, 4.0, weight_decay=0.0)
                      / _first_update(torch.optim.AdamW, 1.0, weight_decay=0.0))}


def _probe_all():
    """Every probe, one launch: {name: result}."""
    return {name: fn() for name, fn in (
        ("buckets", _probe_buckets), ("first_bucket", _probe_first_bucket), ("hooks", _probe_hooks),
        ("powersgd", _probe_powersgd), ("view", _probe_view), ("unused", _probe_unused),
        ("buffers", _probe_buffers), ("fsdp", _probe_fsdp_reduce_dtype),
        ("optimizers", _probe_optimizers),
        ("join", _probe_join), ("sync_batchnorm", _probe_sync_batchnorm), ("hang", _probe_hang))}


@pytest.fixture(scope="module")
def ranks():
    """The probes' results on each of 2 gloo ranks (CPU, no GPU visible)."""
    return dpcourse.run(_probe_all, world_size=2, backend="gloo", device="cpu", timeout=240)


def _by_rank(ranks, probe):
    return [r[probe] for r in ranks]


# =================================================================== lesson 10


def test_gloo_default_timeout_is_30_minutes():
    """Lesson 00, "When a rank fails", and lesson 10, section 1: a process group over gloo waits
    30 minutes by default before a collective that never completes fails."""
    from torch.distributed import constants
    from torch.distributed.distributed_c10d import _get_default_timeout

    assert constants.default_pg_timeout == timedelta(minutes=30)
    assert _get_default_timeout(dist.Backend.GLOO) == timedelta(minutes=30)


@pytest.mark.gpu
@pytest.mark.skipif(not dist.is_nccl_available(), reason="torch built without NCCL")
def test_nccl_default_timeout_is_10_minutes():
    """Lesson 00, "When a rank fails", and lesson 10, section 1: an NCCL process group's default
    timeout is 10 minutes."""
    from torch.distributed import constants
    from torch.distributed.distributed_c10d import _get_default_timeout

    assert constants.default_pg_nccl_timeout == timedelta(minutes=10)
    assert _get_default_timeout(dist.Backend.NCCL) == timedelta(minutes=10)


def test_ddp_rank_with_extra_batch_waits_in_all_reduce_until_timeout(ranks):
    """Lesson 10, section 1: torch DDP with one rank a batch short: the other rank waits in the
    all-reduce of its extra step until the process group's timeout (3 s here), then fails."""
    longer, shorter = _by_rank(ranks, "hang")
    assert shorter["error"] is None
    assert longer["error"] is not None and "Timed out" in longer["error"], longer
    assert longer["waited"] >= 2.9


def test_distributed_sampler_gives_every_rank_the_same_length():
    """Lesson 01, answer to the 3-shard "Predict, then run", and lesson 10, section 1: torch's
    DistributedSampler gives every rank the same number of samples; by default
    (drop_last=False) it pads by repeating examples from the start, with drop_last=True it drops
    the remainder."""
    from torch.utils.data import DistributedSampler

    def shards(drop_last):
        return [list(DistributedSampler(range(10), num_replicas=3, rank=r, shuffle=False,
                                        drop_last=drop_last)) for r in range(3)]

    assert _defaults(DistributedSampler.__init__)["drop_last"] is False
    padded, dropped = shards(False), shards(True)
    assert [len(s) for s in padded] == [4, 4, 4]
    assert Counter(sum(padded, [])) == Counter(list(range(10)) + [0, 1])  # 0 and 1 twice
    assert [len(s) for s in dropped] == [3, 3, 3]
    assert sorted(sum(dropped, [])) == list(range(9))  # example 9 is left out


def test_join_shadows_collectives_with_zero_buckets(ranks):
    """Lesson 10, section 2: under Join, a rank that ran out of data issues the same collectives
    as the others' steps: per step of the longest rank a "not joined" flag, a "will sync" flag
    and one all-reduce per bucket, its buckets all zeros; then two more all-reduces to finish."""
    longer, joined = _by_rank(ranks, "join")
    assert longer["ops"] == joined["ops"]
    assert longer["hook_calls"] == joined["hook_calls"]
    assert longer["zero_buckets"] == 0
    # rank 1 trained 1 step of 3: it shadowed steps 2 and 3 (2 buckets each) with zeros
    assert joined["zero_buckets"] == 4 and joined["buckets"] == 2
    steps = 3
    assert joined["ops"]["all_reduce"] == 2 * steps + joined["hook_calls"] + 2


def test_join_divides_by_initial_world_size_by_default(ranks):
    """Lesson 10, section 2: under Join the averaged gradient is divided by the initial world
    size; Join(..., divide_by_initial_world_size=False) divides by the ranks still training."""
    longer = _by_rank(ranks, "join")[0]
    assert longer["divide_True"] == pytest.approx(0.5, abs=1e-6)
    assert longer["divide_False"] == pytest.approx(1.0, abs=1e-6)


def test_join_ends_with_equal_parameters(ranks):
    """Lesson 10, section 2: when every rank has joined, torch DDP copies the parameters of one
    of the last ranks to finish to every rank: all end equal."""
    assert all(r["equal_params"] for r in _by_rank(ranks, "join"))


def test_ddp_broadcasts_rank0_buffers_before_forward(ranks):
    """Lesson 10, section 3: torch DDP copies rank 0's buffers to every rank before each forward
    unless broadcast_buffers=False; it sends them coalesced, one broadcast per dtype (BatchNorm's
    three buffers running_mean, running_var, num_batches_tracked: two broadcasts)."""
    for rank, r in enumerate(_by_rank(ranks, "buffers")):
        assert torch.equal(r["default"]["seen"], torch.ones(4))  # rank 0's value, on every rank
        assert torch.equal(r["off"]["seen"], torch.full((4,), float(rank + 1)))  # its own
        assert r["buffers"] == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
        assert r["dtypes"] == 2 and r["default"]["ops"] == {"broadcast": 2}
        assert r["off"]["ops"] == {}


def test_ddp_state_dict_keys_carry_module_prefix(ranks):
    """Lesson 10, section 6: torch DDP's state_dict() prefixes every key with "module.", and a
    bare model's load_state_dict refuses such keys (strict loading, the default)."""
    assert all(r["prefixed"] for r in _by_rank(ranks, "buffers"))
    net = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="Missing key"):
        net.load_state_dict({"module." + k: v for k, v in net.state_dict().items()})


def test_sync_batchnorm_module_refuses_cpu_input(ranks):
    """Lesson 10, section 3: torch's nn.SyncBatchNorm refuses CPU tensors in a distributed run
    (it supports GPU and XPU-like devices only)."""
    for r in _by_rank(ranks, "sync_batchnorm"):
        assert r["module_on_cpu"].startswith("SyncBatchNorm expected input tensor to be on GPU")


def test_sync_batchnorm_all_gathers_stats_forward_all_reduces_backward(ranks):
    """Lesson 10, section 3: torch's SyncBatchNorm function all-gathers each rank's
    [mean, invstd, count] (2C + 1 numbers) in forward and all-reduces [sum dy, sum dy*(x-mean)]
    (2C numbers) in backward, and matches BatchNorm on the global batch. Its statistics kernels
    have no CPU implementation: CPU equivalents stand in for them here; the collectives and
    their order are torch's own."""
    for r in _by_rank(ranks, "sync_batchnorm"):
        assert r["forward"] == [("all_gather", torch.float32, 2 * 3 + 1)]
        assert r["backward"] == [("all_reduce", torch.float32, 2 * 3)]
        assert max(r["output_error"], r["grad_error"], r["running_error"]) < 1e-5


def _nccl_sync_batchnorm():
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    bn = torch.nn.SyncBatchNorm(3).to(device)
    x = torch.randn(8, 3, device=device, requires_grad=True)
    with _recording(*_GATHERS) as forward_calls:
        y = bn(x)
    with _recording("all_reduce") as backward_calls:
        y.sum().backward()
        torch.cuda.synchronize()
    return forward_calls, backward_calls


@pytest.mark.gpu(2)
def test_sync_batchnorm_on_nccl_gathers_forward_reduces_backward():
    """Lesson 10, section 3: on GPUs over NCCL, nn.SyncBatchNorm issues one all-gather of
    2C + 1 numbers per layer in forward and one all-reduce of 2C numbers in backward."""
    for forward_calls, backward_calls in dpcourse.run(_nccl_sync_batchnorm, world_size=2,
                                                      backend="nccl", timeout=120):
        assert [c[2] for c in forward_calls] == [2 * 3 + 1]
        assert [(c[0], c[2]) for c in backward_calls] == [("all_reduce", 2 * 3)]


def test_sgd_step_scales_with_gradient_adamw_step_does_not(ranks):
    """Lesson 10, section 5: torch's SGD step is lr x gradient, so a loss 4x too large makes a
    4x step; AdamW's first step is lr x m / (sqrt(v) + eps), which the scale cancels (to eps).
    (Measured in the ranks, where torch's optimizer machinery is already loaded.)"""
    r = ranks[0]["optimizers"]
    assert r["SGD"] == pytest.approx(4.0, rel=1e-5)
    assert r["AdamW"] == pytest.approx(1.0, rel=1e-3)


# =================================================================== lesson 11


def test_comm_hook_bucket_interface_and_future_value(ranks):
    """Lesson 11, section 1: torch's reducer calls hook(state, bucket) with a bucket offering
    buffer() (flat, 1-D), gradients(), parameters(), index() and is_last(); the value of the
    future the hook returns is what lands in the parameters' gradients."""
    for r in _by_rank(ranks, "hooks"):
        assert r["api"] == dict(buffer_is_1d=True, index="int", is_last="bool",
                                grads_match_params=True, grads_sum_to_buffer=True)
        assert r["seven"]


def test_default_reduction_is_the_mean_over_ranks(ranks):
    """Lesson 11, section 1: without a hook torch DDP's bucket reduction is the sum over ranks
    divided by the world size."""
    for r in _by_rank(ranks, "hooks"):
        mean = sum(r["local_grads"]) / len(r["local_grads"])
        assert torch.allclose(r["default"], mean, atol=1e-6)


def test_16_bit_hooks_send_16_bits_and_return_fp32(ranks):
    """Lesson 11, sections 1 and 2: torch's fp16_compress_hook and bf16_compress_hook all-reduce
    the bucket as float16 / bfloat16 (2 bytes per element on the wire); the gradients come back
    as float32 holding the 16-bit sum. (The hooks cast before they divide by the world size:
    tests/test_torch_facts_reducer.py::test_16_bit_hooks_cast_to_16_bits_then_divide_in_16_bits.)"""
    for r in _by_rank(ranks, "hooks"):
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            h = r[name]
            assert h["wire"] == [dtype] and h["wire_numel"] == h["numel"]
            assert h["result_dtype"] == torch.float32 and h["exact"]


def test_ddp_accepts_bf16_hook_only_with_cuda_and_nccl(ranks):
    """Lesson 11, section 1: torch DDP refuses to register bf16_compress_hook unless torch is
    built with CUDA and NCCL 2.10+ (or XPU with XCCL); a CPU-only torch refuses it."""
    cuda_nccl = (torch.version.cuda is not None and dist.is_nccl_available()
                 and torch.cuda.nccl.version() >= (2, 10))
    for r in _by_rank(ranks, "hooks"):
        if cuda_nccl:
            assert r["bf16_register"] == "accepted"
        elif not (hasattr(dist, "is_xccl_available") and dist.is_xccl_available()):
            assert "BF16" in r["bf16_register"]


def test_fsdp_reduce_dtype_bf16_reduce_scatters_bf16(ranks):
    """Lesson 11, section 2 (forward link to lesson 14): fully_shard with
    MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) reduce-scatters its gradients in bfloat16
    and hands the optimizer float32 gradient shards."""
    for r in _by_rank(ranks, "fsdp"):
        assert r["wire"] and set(r["wire"]) == {torch.bfloat16}
        assert r["grads"] == {torch.float32}


def test_16_bit_mantissa_bits():
    """Lesson 11, section 2: float16 keeps 10 explicit mantissa bits, bfloat16 7."""
    assert torch.finfo(torch.float16).eps == 2.0**-10
    assert torch.finfo(torch.bfloat16).eps == 2.0**-7


def test_powersgd_defaults():
    """Lesson 11, section 2: PowerSGDState's defaults: start_powerSGD_iter=1000 steps of plain
    all-reduce first, error feedback on, rank 1, min_compression_rate 2; its documentation
    warns that compressing too early can hurt accuracy."""
    params = _defaults(powerSGD_hook.PowerSGDState.__init__)
    assert params["start_powerSGD_iter"] == 1000
    assert params["use_error_feedback"] is True
    assert params["matrix_approximation_rank"] == 1
    assert params["min_compression_rate"] == 2
    doc = " ".join(powerSGD_hook.PowerSGDState.__doc__.split())
    assert "compressing gradients too early" in doc


def test_powersgd_sends_full_gradient_then_low_rank_factors(ranks):
    """Lesson 11, section 1: torch's PowerSGD hook all-reduces the full gradient for its first
    start_powerSGD_iter steps, then for each matrix worth compressing only two rank-r factors
    (n*r + m*r numbers); vectors and small matrices go uncompressed."""
    for r in _by_rank(ranks, "powersgd"):
        full = sum(torch.Size(s).numel() for s in r["shapes"])
        rank_r, min_rate = 1, 2
        compressed = 0
        for s in r["shapes"]:
            n, m = s[0], torch.Size(s[1:]).numel()
            worth = len(s) > 1 and (n + m) * rank_r * min_rate < n * m
            compressed += (n + m) * rank_r if worth else n * m
        assert r["per_step"] == [full, full, compressed, compressed]
        assert compressed < full / 5


def test_powersgd_keeps_error_feedback_residual(ranks):
    """Lesson 11, section 2: with use_error_feedback (the default) torch's PowerSGD hook keeps,
    per bucket, a residual the size of the bucket once it compresses; without it, none."""
    for r in _by_rank(ranks, "powersgd"):
        full = sum(torch.Size(s).numel() for s in r["shapes"])
        assert [n for n, _ in r["residuals"].values()] == [full]  # one bucket here
        assert all(norm > 0 for _, norm in r["residuals"].values())
        assert r["residuals_off"] == 0


def test_first_iteration_uses_one_bucket_then_rebuilds(ranks):
    """Lesson 05, introduction, and lesson 11, section 3: with find_unused_parameters=False
    torch DDP puts every gradient in one bucket for the first step (no overlap in step 1),
    rebuilds its buckets in the order the gradients arrived before the second step (two
    broadcasts), and never again."""
    for r in _by_rank(ranks, "buckets"):
        for cfg in ("default", "cap"):
            steps = r[cfg]
            assert steps[0]["params"] == [list(range(r["n_params"]))]
            assert [s["ops"].get("broadcast", 0) for s in steps] == [0, 2, 0]
        # bucket_cap_mb applies from step 2, in arrival order: the last layer's gradients first
        assert [s["params"] for s in r["cap"]][1:] == [[[2, 3, 4, 5], [0, 1]]] * 2


def test_first_bucket_is_1_mib_after_rebuild_with_default_cap(ranks):
    """Lesson 11, section 3: with the default bucket_cap_mb (25 MiB) torch DDP's rebuilt buckets
    start with a small one of about 1 MiB, the first to fill in backward."""
    for r in _by_rank(ranks, "first_bucket"):
        assert r["cap"] == 25 * MiB
        assert r["sizes"][0] == [r["total"]]
        first = r["sizes"][1][0]
        assert MiB <= first < MiB + r["layer"] + 4 * 256  # closes once past 1 MiB
        assert len(r["sizes"][1]) == 2


def test_find_unused_parameters_buckets_in_reverse_order_without_rebuild(ranks):
    """Lesson 11, sections 3 and 4: with find_unused_parameters=True torch DDP buckets by size
    from the first step, in reverse registration order (bucket 0 holds the last parameters),
    does not rebuild, and all-reduces one more tensor (the used-parameter map) every step."""
    for r in _by_rank(ranks, "buckets"):
        assert r["find_unused"][0]["params"] == [[3, 4, 5], [0, 1, 2]]
        for s in r["find_unused"]:
            assert s["buckets"] == 2 and s["ops"] == {"all_reduce": 3}


def test_unused_parameter_without_option_fails_next_forward(ranks):
    """Lesson 11, section 4: with a parameter the forward never uses and neither option, torch
    DDP raises at the next step's forward, naming find_unused_parameters."""
    for r in _by_rank(ranks, "unused"):
        assert "Expected to have finished reduction in the prior iteration" in r["default"]
        assert "find_unused_parameters=True" in r["default"]


def test_unused_parameters_extra_all_reduce_and_static_graph(ranks):
    """Lesson 11, section 4: find_unused_parameters=True costs one all-reduce beyond the
    buckets' in every step; static_graph=True only in the first; the unused parameters'
    .grad stays None either way."""
    for r in _by_rank(ranks, "unused"):
        assert r["find_unused"]["extra"] == [1, 1, 1]
        assert r["static"]["extra"] == [1, 0, 0]
        for name in ("find_unused", "static"):
            assert r[name]["grads"] == ["unused.weight", "unused.bias"]


def test_static_graph_rebuilds_after_second_step(ranks):
    """Lesson 11, section 4: with static_graph=True torch DDP keeps one bucket for two steps
    and rebuilds before the third."""
    for r in _by_rank(ranks, "buckets"):
        assert [s["buckets"] for s in r["static"]] == [1, 1, 2]
        assert [s["ops"].get("broadcast", 0) for s in r["static"]] == [0, 0, 2]


def test_gradient_as_bucket_view(ranks):
    """Lesson 11, section 5: gradient_as_bucket_view is off by default; with True every
    param.grad shares the bucket's storage, with False none does."""
    assert _defaults(DDP.__init__)["gradient_as_bucket_view"] is False
    for r in _by_rank(ranks, "view"):
        assert all(r[True]) and not any(r[False])


# -- Lessons 00-04 -----------------------------------------------------------------------------


def _reduce_with_every_op():
    """On each rank: all-reduce ``rank + 1`` with every ReduceOp (int64; float32 for AVG); the
    value or the error."""
    out = {}
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        t = torch.tensor([dist.get_rank() + 1], dtype=torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out[name] = t.item()
    t = torch.tensor([dist.get_rank() + 1.0])  # AVG divides: a float tensor
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["AVG"] = t.item()
    try:
        dist.all_reduce(torch.ones(1), op=dist._make_nccl_premul_sum(2.0))
        out["PREMUL_SUM"] = "accepted"
    except (RuntimeError, ValueError) as exc:
        out["PREMUL_SUM"] = str(exc)
    try:
        dist.all_reduce(torch.ones(1), op=lambda a, b: a + b)
        out["python function"] = "accepted"
    except TypeError as exc:
        out["python function"] = type(exc).__name__
    return out


def test_reduce_ops_are_a_fixed_set():
    """Lesson 00, answer to "Predict, then run": an all-reduce's ``op`` is one of
    ``dist.ReduceOp``'s fixed operations, SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR
    and PREMUL_SUM (``UNUSED``, where a version lists it, is no operation)."""
    names = set(dist.ReduceOp.RedOpType.__members__) - {"UNUSED"}
    assert names == {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"}


def test_gloo_reduce_ops():
    """Lesson 00, answer to "Predict, then run": on gloo SUM, PRODUCT, MIN, MAX, BAND,
    BOR, BXOR and AVG leave every rank with the same result; gloo refuses PREMUL_SUM; a
    Python function as ``op`` is refused with a TypeError."""
    results = dpcourse.run(_reduce_with_every_op, world_size=2, backend="gloo", device="cpu")
    expected = dict(SUM=1 + 2, PRODUCT=1 * 2, MIN=1, MAX=2, BAND=1 & 2, BOR=1 | 2, BXOR=1 ^ 2,
                    AVG=(1.0 + 2.0) / 2)
    for r in results:
        assert {k: r[k] for k in expected} == expected
        assert "PREMUL_SUM" in r["PREMUL_SUM"] and "Gloo" in r["PREMUL_SUM"]
        assert r["python function"] == "TypeError"


def _ddp_and_local_gradients():
    """On each rank: the gradient torch DDP leaves, and every rank's own local gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    plain = torch.nn.Linear(4, 1)
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model)
    torch.manual_seed(100 + rank)  # different data on every rank
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    local = torch.cat([p.grad.flatten() for p in plain.parameters()])
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    return dict(ddp=torch.cat([p.grad.flatten() for p in model.parameters()]),
                mean=torch.stack(everyone).mean(0), local=local)


def test_ddp_gradient_is_mean_over_ranks():
    """Lesson 03, "The whole algorithm": after backward, torch DDP's gradient is the mean
    of the ranks' local gradients (their sum divided by the world size), on every rank."""
    for n in (2, 3):
        for r in dpcourse.run(_ddp_and_local_gradients, world_size=n, backend="gloo", device="cpu"):
            assert torch.allclose(r["ddp"], r["mean"], rtol=1e-6, atol=1e-7)
            assert not torch.allclose(r["ddp"], r["local"], rtol=1e-3)  # not this rank's own


def _float16_sums():
    """On each rank: a float16 gradient of 40000 averaged by torch DDP, and the plain float16 sum."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Linear(1, 1, bias=False).half()
    ddp = DDP(model)
    ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()  # d/dw (w x) = x
    summed = torch.tensor([40000.0], dtype=torch.float16)
    dist.all_reduce(summed)
    return dict(ddp=model.weight.grad.item(), sum_first=summed.item(),
                max_float16=torch.finfo(torch.float16).max)


def test_ddp_divides_float16_gradients_before_summing():
    """Lesson 03, "The whole algorithm": torch DDP divides before it sums. Two ranks each
    with a float16 gradient of 40000: the float16 sum (80000) overflows to inf (float16
    ends at 65504), yet DDP's averaged gradient is 40000, so each rank's gradient was
    halved before the all-reduce added them."""
    for r in dpcourse.run(_float16_sums, world_size=2, backend="gloo", device="cpu"):
        assert r["max_float16"] == 65504.0
        assert r["sum_first"] == float("inf")
        assert r["ddp"] == 40000.0


def _buffers_after_forwards():
    """On each rank: BatchNorm's running mean after each of 3 forwards under torch DDP's defaults."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=0.0))
    ddp = DDP(model)
    seen = []
    for _ in range(3):
        with torch.no_grad():
            model[1].running_mean.fill_(float(dist.get_rank()))  # this rank's own value
        ddp(torch.randn(8, 4)).sum().backward()
        seen.append(model[1].running_mean.tolist())
    # The flag that governs it: broadcast_buffers (renamed forward_sync_buffers in torch 2.13).
    flag = ddp.forward_sync_buffers if hasattr(ddp, "forward_sync_buffers") else ddp.broadcast_buffers
    return dict(seen=seen, flag=flag)


def test_ddp_broadcasts_buffers_before_every_forward_by_default():
    """Lesson 02, introduction and "Broadcast before every forward": with its default
    arguments torch DDP copies rank 0's buffers to every rank before every forward (its
    ``broadcast_buffers`` flag, ``forward_sync_buffers`` from torch 2.13, is on)."""
    for r in dpcourse.run(_buffers_after_forwards, world_size=2, backend="gloo", device="cpu"):
        assert r["seen"] == [[0.0] * 4] * 3
        assert r["flag"] is True


def _p2p_on_a_subgroup():
    """Ranks 1 and 2 exchange over the group {1, 2}: naming each other by global rank (peer=,
    dst=, src=), then by group rank (group_peer=, group_dst=, group_src=)."""
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    peer = 3 - rank  # 1 <-> 2: global ranks; their ranks inside the group are 0 and 1
    group_peer = 1 - dist.get_rank(group)
    out = dict(group_rank=dist.get_rank(group))
    for name, by_global in (("received", True), ("received_by_group_rank", False)):
        send, recv = torch.tensor([float(rank)]), torch.zeros(1)
        addr = dict(peer=peer) if by_global else dict(group_peer=group_peer)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group=group, **addr),
                                        dist.P2POp(dist.irecv, recv, group=group, **addr)])
        for w in works:
            w.wait()
        out[name] = recv.item()
    # blocking send/recv, group rank 0 sending first
    sent, got = torch.tensor([10.0 * rank]), torch.zeros(1)
    for by_global in (True, False):
        to = dict(dst=peer) if by_global else dict(group_dst=group_peer)
        frm = dict(src=peer) if by_global else dict(group_src=group_peer)
        if out["group_rank"] == 0:
            dist.send(sent, group=group, **to)
            dist.recv(got, group=group, **frm)
        else:
            dist.recv(got, group=group, **frm)
            dist.send(sent, group=group, **to)
        out["send_recv_global" if by_global else "send_recv_group"] = got.item()
    return out


def test_p2p_peers_are_global_ranks():
    """Lesson 04, "The code": on a sub-group, a point-to-point call's dst/src (and P2POp's peer)
    is a global rank (rank 2 of the world is rank 1 of the group {1, 2}, and is addressed as 2);
    torch 2.13 also takes group_dst/group_src (and P2POp's group_peer), a rank inside the group,
    with the same result."""
    results = dpcourse.run(_p2p_on_a_subgroup, world_size=3, backend="gloo", device="cpu")
    assert results[0] is None
    for rank, group_rank, other in ((1, 0, 2), (2, 1, 1)):
        assert results[rank] == dict(group_rank=group_rank, received=float(other),
                                     received_by_group_rank=float(other),
                                     send_recv_global=10.0 * other, send_recv_group=10.0 * other)


def test_distributed_sampler_shuffles_with_seed_plus_epoch():
    """Lesson 03, "Why set_epoch": torch's DistributedSampler seeds its shuffle with
    ``seed + epoch``, the same on every rank, and the ranks split that one order between
    them; without ``set_epoch`` the epoch stays 0."""
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(64))
    moved = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    moved.set_epoch(2)
    assert list(moved) == list(DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=5))
    ranks = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == data  # one shared order, split: every example once
    fixed = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    assert list(fixed) == list(fixed) == ranks[0]  # nothing advances the epoch by itself


# -- Lessons 05-09 -----------------------------------------------------------------------------


def _on_two_cpu_ranks(fn, *args):
    return dpcourse.run(fn, *args, world_size=2, device="cpu")


def ddp_bucket_sizes(cap_kwargs, width: int = 887) -> list[int]:
    """Bytes of every bucket torch DDP all-reduces in its second step, in the order it hands
    them to a comm hook; the model is ten bias-free ``Linear(width, width)`` layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(10)])
    ddp = DDP(model, **cap_kwargs)
    sizes = []

    def hook(state, bucket):
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # the second step runs on the buckets DDP rebuilds after the first
        sizes.clear()
        ddp(torch.randn(2, width)).sum().backward()
    return sizes


def _bucket_sizes_by_cap():
    # Ten 3 MiB tensors: 30 MiB of gradients, so a 25 MiB cap shows in the bucket sizes.
    return {name: ddp_bucket_sizes(kw) for name, kw in (
        ("default", {}), ("cap25", {"bucket_cap_mb": 25}), ("cap5", {"bucket_cap_mb": 5}))}


def test_ddp_default_bucket_cap_is_25_mib():
    """L04, L05 c0, L11: torch DDP's default cap is 25 MiB. Ten 3 MiB gradients, in the order
    DDP hands over its rebuilt buckets: the default sends the first gradient to arrive alone
    (its small first bucket, about 1 MiB:
    tests/test_torch_facts_collectives.py::test_small_first_bucket_only_with_the_default_cap,
    closes at once), then the other nine as one bucket, which closes only past 25 MiB (eight
    make 24 MiB); bucket_cap_mb=25 makes the same 25 MiB bucket from the first gradient on, and
    a 5 MiB cap makes buckets of two."""
    sizes = _on_two_cpu_ranks(_bucket_sizes_by_cap)[0]
    layer = 887 * 887 * 4
    assert 8 * layer < 25 * MiB <= 9 * layer
    assert sizes["default"] == [layer, 9 * layer]
    assert sizes["cap25"] == [9 * layer, layer]
    assert sizes["cap5"] == [2 * layer] * 5


def test_backward_accumulates_into_an_existing_grad_in_place():
    """L05, "Into the bucket and back": when param.grad already exists (here a view of a slice of
    one flat buffer), autograd adds the new gradient into it in place: param.grad keeps its
    memory, and the flat buffer holds the gradient (twice it after two backwards)."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(4, 3), torch.randn(5, 4)
    reference = copy.deepcopy(layer)
    reference(x).sum().backward()
    params = list(layer.parameters())
    buf = torch.zeros(sum(p.numel() for p in params))
    ptrs, start = [], 0
    for p in params:
        p.grad = buf[start:start + p.numel()].view_as(p)  # zeros, in the buffer's memory
        ptrs.append(p.grad.data_ptr())
        start += p.numel()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    for times in (1, 2):
        layer(x).sum().backward()
        assert [p.grad.data_ptr() for p in params] == ptrs  # still the buffer's slices
        assert torch.allclose(buf, times * expected)


def test_zero_grad_sets_gradients_to_none_by_default():
    """L05 c9: after zero_grad() (Module's and Optimizer's), param.grad is None: set_to_none=True."""
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for zero_grad in (layer.zero_grad, opt.zero_grad):
        layer(torch.randn(4, 3)).sum().backward()
        assert all(p.grad is not None for p in layer.parameters())
        zero_grad()
        assert all(p.grad is None for p in layer.parameters())


def _grad_storages(as_view):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    ddp = DDP(model, gradient_as_bucket_view=as_view)
    for _ in range(2):  # the second step runs on the buckets as rebuilt after the first
        ddp(torch.randn(4, 8)).sum().backward()
    return len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}), len(list(model.parameters()))


def test_ddp_gradient_as_bucket_view_puts_gradients_in_the_bucket():
    """L05 c9, L06 c7: with gradient_as_bucket_view=True every param.grad lives in the one bucket's
    storage; the default (False) keeps a separate tensor per gradient."""
    import inspect

    assert inspect.signature(DDP.__init__).parameters[
        "gradient_as_bucket_view"].default is False
    storages, n = _on_two_cpu_ranks(_grad_storages, True)[0]
    assert (storages, n) == (1, 4)
    storages, n = _on_two_cpu_ranks(_grad_storages, False)[0]
    assert (storages, n) == (4, 4)


def _muls_and_divs_in_backward():
    from torch.profiler import ProfilerActivity, profile

    def count(module, params):
        x = torch.randn(4, 8)
        module(x).sum().backward()  # DDP's first backward also rebuilds its buckets
        for p in params:
            p.grad = None  # what zero_grad() does by default
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            module(x).sum().backward()
        names = Counter(e.name for e in prof.events())
        return names["aten::mul"], names["aten::div"] + names["aten::div_"]

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    wrapped = copy.deepcopy(plain)
    n = len(list(plain.parameters()))
    return count(plain, list(plain.parameters())), count(DDP(wrapped), list(wrapped.parameters())), n


def test_ddp_divides_each_gradient_as_it_copies_it_into_the_bucket():
    """L06: torch DDP's reducer runs one aten::mul per parameter in backward (the gradient times
    1/world size, written into its bucket) and no division of the bucket afterwards."""
    (plain_muls, plain_divs), (ddp_muls, ddp_divs), n = _on_two_cpu_ranks(_muls_and_divs_in_backward)[0]
    assert ddp_muls - plain_muls == n == 6
    assert ddp_divs == plain_divs


def test_post_accumulate_grad_hooks_fire_last_layer_first_after_grad_is_written():
    """L06 c2/c3: register_post_accumulate_grad_hook calls fn(param) once param.grad holds the
    gradient, and backward reaches the last layer's parameters first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 1))
    seen = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, p.grad is not None and bool(p.grad.abs().sum() > 0))))
    model(torch.randn(8, 4)).sum().backward()
    layers = [int(name.split(".")[0]) for name, _ in seen]
    assert len(seen) == 6 and all(ready for _, ready in seen)
    assert layers == sorted(layers, reverse=True)



@pytest.mark.parametrize("create_graph", [False, True])
def test_post_accumulate_grad_hooks_run_in_grad_mode_only_under_create_graph(create_graph):
    """``Bucket.place_grad``'s comment: autograd runs a backward, its hooks included, with grad
    mode off, unless ``backward(create_graph=True)``; so only then must a hook's copy of the
    gradient be kept out of the graph."""
    model = torch.nn.Linear(4, 1)
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(torch.is_grad_enabled()))
    model(torch.randn(3, 4)).pow(2).sum().backward(create_graph=create_graph)
    assert torch.is_grad_enabled()  # the caller's mode is unchanged
    assert seen == [create_graph] * 2

def _async_all_reduce():
    t = torch.full((4,), float(dist.get_rank() + 1))
    work = dist.all_reduce(t, async_op=True)
    handle = type(work).__name__, hasattr(work, "wait")
    work.wait()
    return handle, t.tolist()


def test_async_all_reduce_returns_a_work_handle():
    """L06 c5: all_reduce(..., async_op=True) returns a work handle; after wait() the sum is in place."""
    (name, has_wait), values = _on_two_cpu_ranks(_async_all_reduce)[0]
    assert has_wait and name != "NoneType"
    assert values == [3.0] * 4


def test_torch_cat_copies():
    """L06 c7/c8: torch.cat returns new memory; writing it leaves the inputs alone."""
    a, b = torch.zeros(3), torch.zeros(2)
    flat = torch.cat([a, b])
    flat.add_(1)
    assert flat.untyped_storage().data_ptr() not in (a.untyped_storage().data_ptr(),
                                                     b.untyped_storage().data_ptr())
    assert a.sum() == 0 and b.sum() == 0


def _no_sync_flag():
    ddp = DDP(torch.nn.Linear(2, 1))
    before = ddp.require_backward_grad_sync
    with ddp.no_sync():
        inside = ddp.require_backward_grad_sync
    return before, inside, ddp.require_backward_grad_sync


def test_ddp_no_sync_sets_and_restores_a_flag():
    """L07 c9: no_sync() sets require_backward_grad_sync to False and restores it on exit."""
    assert _on_two_cpu_ranks(_no_sync_flag)[0] == (True, False, True)


def _split_no_sync():
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(dist.get_rank() + 1))   # different data on each rank

    def grads_agree():
        g = ddp.module.weight.grad.clone()
        other = [torch.zeros_like(g) for _ in range(2)]
        dist.all_gather(other, g)
        ddp.zero_grad()
        return torch.equal(other[0], other[1])

    with ddp.no_sync():
        loss = ddp(x).sum()            # forward inside
    loss.backward()                    # backward outside
    a = grads_agree()
    loss = ddp(x).sum()                # forward outside
    with ddp.no_sync():
        loss.backward()                # backward inside
    b = grads_agree()
    return a, b


def test_ddp_decides_no_sync_at_forward():
    """L07 c9/c10: torch DDP reads the flag at forward time: forward inside no_sync with backward
    outside leaves the gradients local; forward outside with backward inside averages them."""
    forward_inside, forward_outside = _on_two_cpu_ranks(_split_no_sync)[0]
    assert forward_inside is False and forward_outside is True


def _huge_gradient():
    # A gradient of 3e38 on both ranks: summing first overflows float32 (max 3.4e38) to inf,
    # dividing by the world size first gives 1.5e38 + 1.5e38 = 3e38.
    ddp = DDP(torch.nn.Linear(1, 1, bias=False))
    ddp(torch.full((1, 1), 3e38)).sum().backward()
    return ddp.module.weight.grad.item()


def test_ddp_divides_by_world_size_before_summing():
    """L08 c8: torch DDP divides each gradient by the world size before the all-reduce sums."""
    grad = _on_two_cpu_ranks(_huge_gradient)[0]
    assert grad == pytest.approx(3e38, rel=1e-6)


class _NotATensor:
    pass


def test_weights_only_load_refuses_other_objects():
    """L08 c4: torch.load(..., weights_only=True) loads tensors and plain containers and refuses
    an arbitrary pickled object."""
    ok, bad = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.ones(2), "step": 3, "names": ["a"]}, ok)
    torch.save({"obj": _NotATensor()}, bad)
    ok.seek(0)
    bad.seek(0)
    assert torch.load(ok, weights_only=True)["step"] == 3
    with pytest.raises(pickle.UnpicklingError):
        torch.load(bad, weights_only=True)


def test_adamw_state_is_a_step_and_two_moments_shaped_like_the_parameter():
    """L08 c10, L09 c16: AdamW keeps a step count and two moments per parameter, of the parameter's
    shape and dtype: 8 bytes per float32 parameter."""
    layer = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, 5)).sum().backward()
    opt.step()
    for p in layer.parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == 1.0
        moments = [state["exp_avg"], state["exp_avg_sq"]]
        assert all(m.shape == p.shape and m.dtype == torch.float32 for m in moments)
        assert sum(m.numel() * m.element_size() for m in moments) == 8 * p.numel()


def test_autocast_keeps_parameters_and_gradients_float32():
    """L09 c16: under autocast a Linear computes in bfloat16, but its weight stays float32, so its
    gradient (what DDP all-reduces) is float32 too."""
    layer = torch.nn.Linear(16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(4, 16))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert layer.weight.dtype == torch.float32
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32


def test_bfloat16_weight_loses_a_small_update():
    """L09 c16: a bf16 weight cannot take a small update (1 + 0.001 rounds back to 1), which is why
    mixed-precision training keeps fp32 master weights; in fp32 the update survives."""
    for dtype, kept in ((torch.bfloat16, False), (torch.float32, True)):
        w = torch.ones(1, dtype=dtype)
        w.add_(torch.full((1,), 1e-3, dtype=dtype))
        assert (w.item() != 1.0) is kept


# -- Lessons 12-14 -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CollectiveDtypes(TorchDispatchMode):
    """Record every c10d operator torch dispatches, with the dtypes of its tensors."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.calls.append((name.split(".")[1], {t.dtype for t in tensors}))
        return func(*args, **(kwargs or {}))


def _fully_shard_bf16() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.bfloat16))
    with _CollectiveDtypes() as seen:
        out = model(torch.randn(4, 8))
        out.float().pow(2).mean().backward()
    return {"calls": seen.calls, "output": out.dtype,
            "shards": [(p.dtype, p.grad.to_local().dtype) for p in model.parameters()]}


def test_fully_shard_bf16_policy_reduces_gradients_in_bf16_into_fp32_shards():
    """param_dtype=reduce_dtype=bf16: gather and reduce-scatter move bf16, the fp32 shards get fp32 grads."""
    # Ranks started by dpcourse.run: it tears the process group down before the ranks exit,
    # and they skip the interpreter's finalization, where gloo's threads can abort a process.
    results = dpcourse.run(_fully_shard_bf16, world_size=2, backend="gloo", device="cpu",
                           timeout=240)
    for r in results:
        ops = {name for name, _ in r["calls"]}
        assert {"_allgather_base_", "_reduce_scatter_base_"} <= ops, r["calls"]
        for name, dtypes in r["calls"]:
            if name in ("_allgather_base_", "_reduce_scatter_base_"):
                assert dtypes == {torch.bfloat16}, (name, dtypes)   # gathered and reduced in bf16
        assert r["output"] == torch.bfloat16                          # the forward computed in bf16
        assert r["shards"] and all(p == g == torch.float32 for p, g in r["shards"])  # fp32 master shards


def test_symm_mem_all_reduce_operators_exist_with_these_signatures():
    """torch.ops.symm_mem.one_shot_all_reduce returns a new tensor; two_shot_all_reduce_ works in place."""
    one = torch.ops.symm_mem.one_shot_all_reduce.default._schema
    two = torch.ops.symm_mem.two_shot_all_reduce_.default._schema
    assert [a.name for a in one.arguments] == ["input", "reduce_op", "group_name"]
    assert [a.name for a in two.arguments] == ["input", "reduce_op", "group_name"]
    assert two.arguments[0].alias_info is not None and two.arguments[0].alias_info.is_write
    assert one.arguments[0].alias_info is None


def _nccl_ranks(body: str, tmp_path, env: dict | None = None, world: int = 2) -> list[str]:
    """Run ``body`` on ``world`` ranks over NCCL (rank r on cuda:r); return each rank's stdout."""
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        rank = int(os.environ["RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        try:
        {body}
        finally:
            dist.destroy_process_group()
    """).format(body=textwrap.indent(textwrap.dedent(body), "    "))
    port = _free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world), "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=tmp_path) for r in range(world)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.mark.gpu(2)
def test_nccl_reads_nvls_enable_from_the_environment(tmp_path):
    """NCCL_NVLS_ENABLE=0 reaches NCCL: its ENV log says it was set by the environment to 0."""
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ENV",
           "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%p.log")}
    _nccl_ranks("""
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    """, tmp_path, env)
    logs = [p.read_text() for p in tmp_path.glob("nccl.*.log")]
    assert len(logs) == 2
    assert all("NCCL_NVLS_ENABLE set by environment to 0" in log for log in logs), logs


@pytest.mark.gpu(2)
def test_nccl_all_reduce_refuses_cpu_tensors(tmp_path):
    """Over NCCL, dist.all_reduce of a CPU tensor raises: NCCL moves GPU tensors only."""
    outs = _nccl_ranks("""
        try:
            dist.all_reduce(torch.ones(4))
            print("reduced")
        except (RuntimeError, ValueError) as exc:
            print("refused:", type(exc).__name__)
    """, tmp_path)
    assert all("refused:" in out and "reduced" not in out for out in outs), outs


@pytest.mark.gpu(2)
def test_symm_mem_rendezvous_maps_every_peers_buffer(tmp_path):
    """After rendezvous a rank has a pointer per rank to its buffer and signal pad, reads a peer's data,
    and finds its signal pad zeroed; symm_mem's one-shot all-reduce sums a symmetric tensor and
    refuses an ordinary one."""
    outs = _nccl_ranks("""
        import torch.distributed._symmetric_memory as symm_mem
        world, group_name = dist.get_world_size(), dist.group.WORLD.group_name
        buf = symm_mem.empty(16, dtype=torch.float32, device="cuda")
        handle = symm_mem.rendezvous(buf, group_name)
        pad = handle.get_signal_pad(rank, (handle.signal_pad_size // 4,), torch.int32)
        print("pad zero", bool(pad.eq(0).all().item()))
        buf.fill_(float(rank + 1))
        torch.cuda.synchronize()
        dist.barrier()
        peer = (rank + 1) % world
        seen = handle.get_buffer(peer, (16,), torch.float32).clone()
        torch.cuda.synchronize()
        dist.barrier()
        print("ptrs", len(handle.buffer_ptrs), len(handle.signal_pad_ptrs), "peer", seen[0].item())
        total = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        torch.cuda.synchronize()
        print("one-shot sum", total[0].item())
        try:
            torch.ops.symm_mem.one_shot_all_reduce(torch.ones(16, device="cuda"), "sum", group_name)
            torch.cuda.synchronize()
            print("ordinary tensor: reduced")
        except RuntimeError:
            print("ordinary tensor: refused")
        dist.barrier()
    """, tmp_path)
    for r, out in enumerate(outs):
        assert "pad zero True" in out, outs
        assert f"ptrs 2 2 peer {float((r + 1) % 2 + 1)}" in out, outs
        assert "one-shot sum 3.0" in out and "ordinary tensor: refused" in out, outs


@pytest.mark.gpu(2)
def test_nccl_kernel_time_includes_waiting_for_a_late_rank(tmp_path):
    """CUDA events around an NCCL all-reduce on the punctual rank span the late rank's delay."""
    outs = _nccl_ranks("""
        import time
        t = torch.ones(1024, device="cuda")
        dist.all_reduce(t)   # warm-up: the communicator is set up
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        if rank == 1:
            time.sleep(0.5)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(t)
        end.record()
        torch.cuda.synchronize()
        print("gpu ms", start.elapsed_time(end))
    """, tmp_path)
    ms = [float(out.split("gpu ms")[1].split()[0]) for out in outs]
    assert ms[0] > 300 and ms[1] < 100, ms   # rank 0's collective ran while rank 1 slept


def test_meta_device_records_shapes_and_dtypes_without_data():
    """Under torch.device("meta") modules get parameters of the right shape and dtype, and no data."""
    with torch.device("meta"):
        layer = torch.nn.Linear(1000, 500)
    assert all(p.is_meta for p in layer.parameters())
    assert layer.weight.shape == (500, 1000) and layer.weight.dtype == torch.float32
    with pytest.raises((NotImplementedError, RuntimeError)):
        layer.weight.tolist()   # there are no values to read
