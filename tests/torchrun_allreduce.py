"""A tiny script for ``dpcourse launch`` tests: every rank all-reduces its rank + 1.

Prints one line per rank: ``rank R of W: sum S, rendezvous ADDR:PORT``.
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    # One write per line, so that the ranks' lines cannot interleave on the shared stdout.
    sys.stdout.write(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g}, "
                     f"rendezvous {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
