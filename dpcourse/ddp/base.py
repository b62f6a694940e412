"""What every data-parallel wrapper does first: start all replicas from rank 0's state.

The wrappers (:mod:`~dpcourse.ddp.naive`, :mod:`~dpcourse.ddp.bucketed`,
:mod:`~dpcourse.ddp.overlapped`) are standalone; the pieces they share are plain
functions and classes they call: :func:`broadcast_module_state` (defined in
:mod:`dpcourse.ddp.broadcast`), the :class:`~dpcourse.ddp.buckets.Bucket`, the
checks of :mod:`dpcourse.ddp.guards` and torch's options in
:class:`~dpcourse.ddp.reducer.Reducer`. FSDP imports the broadcast from here.
"""

from dpcourse.ddp.broadcast import broadcast_module_state

__all__ = ["broadcast_module_state"]
