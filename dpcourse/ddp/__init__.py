"""Data-parallel wrappers in learning order: naive, bucketed, overlapped.

Each one is a drop-in for ``torch.nn.parallel.DistributedDataParallel``:
rank 0's parameters and buffers are broadcast at construction, and after
``loss.backward()`` every rank holds the gradient averaged over all ranks.
torch DDP's further options (Join, communication hooks, unused parameters,
static graphs, bucket rebuilds) live in :class:`~dpcourse.ddp.reducer.Reducer`,
which every wrapper holds.
"""

from dpcourse.ddp.bucket_assignment import assign_buckets
from dpcourse.ddp.bucketed import DataParallelBucketed
from dpcourse.ddp.buckets import Bucket
from dpcourse.ddp.naive import DataParallelNaive
from dpcourse.ddp.overlapped import DataParallelOverlapped
from dpcourse.ddp.reducer import Reducer

__all__ = ["DataParallelNaive", "DataParallelBucketed", "DataParallelOverlapped",
           "assign_buckets", "Bucket", "Reducer"]
