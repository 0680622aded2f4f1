"""One rank of tests/torch/test_collectives.py's exit check (under ddprun): one DDP step whose Python comm hook
chains a callback that is slow to drop (an object it holds sleeps in __del__, which releases
the GIL), then the script ends at once, holding the DDP model. The completer thread drops that
callback after the step has already returned; libddp_torch's exit hook (ProcessGroupLibddp::
quiesce) lets it finish before the interpreter finalizes. Without it (--no-quiesce) the
completer takes the GIL back during finalization and Python ends it inside C++ frames: the
process aborts with "terminate called without an active exception"."""
import atexit
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import libddp_torch

if "--no-quiesce" in sys.argv:
    atexit.unregister(libddp_torch._C._quiesce)
dist.init_process_group("libddp")


class SlowToDrop:
    def __del__(self):
        time.sleep(0.3)


def hook(state, bucket):
    held = SlowToDrop()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f, held=held: f.value()[0])


model = DDP(torch.nn.Linear(4, 2))
model.register_comm_hook(None, hook)
model(torch.ones(3, 4)).sum().backward()
print(f"STEPPED rank {dist.get_rank()}", flush=True)
