"""Fully sharded data parallelism (ZeRO stage 3): parameters, gradients and state in 1/N per rank."""

from dpcourse.fsdp.cpu_memory import CPUMemoryPeak
from dpcourse.fsdp.flat_params import FlatParams, gathered
from dpcourse.fsdp.materialize import reset_parameters
from dpcourse.fsdp.traffic import fsdp_wire_bytes
from dpcourse.fsdp.unit import FSDPUnit
from dpcourse.fsdp.wrapper import FullyShardedDataParallel, default_units

__all__ = ["FullyShardedDataParallel", "FlatParams", "gathered", "FSDPUnit", "default_units",
           "fsdp_wire_bytes", "reset_parameters", "CPUMemoryPeak"]
