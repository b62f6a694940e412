"""Where notebooks written before :mod:`dpcourse.launch` import the launch errors and stack reader from."""

from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.launch.stacks import describe_wait, main_thread_frames

__all__ = ["RankError", "RankDiedError", "RankTimeoutError", "main_thread_frames", "describe_wait"]
