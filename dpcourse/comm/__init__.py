"""Hand-built collectives and the tracer that makes them visible."""

from dpcourse.comm.trace import CommEvent, CommTrace

__all__ = ["CommTrace", "CommEvent"]
