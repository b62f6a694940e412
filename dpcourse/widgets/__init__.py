"""Interactive widgets for the lessons: a ring all-reduce stepper and a cost-model simulator.

The widgets only draw; the logic lives in plain functions that tests and the
lessons can call without a browser: :func:`simulate_ring` (the ring's schedule,
taken from :mod:`dpcourse.comm.ring`) and :mod:`dpcourse.costmodel`.
"""

from dpcourse.widgets.ringsim import Message, RingFrame, messages_of, simulate_ring
from dpcourse.widgets.simulator import CostModelSimulator
from dpcourse.widgets.stepper import RingStepper, render_frame

__all__ = ["RingStepper", "CostModelSimulator", "simulate_ring", "messages_of", "RingFrame",
           "Message", "render_frame"]
