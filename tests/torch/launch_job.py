"""One rank of tests/torch/test_launch.py: init_process_group("libddp") with the default
env:// after `import libddp_torch`, one all_reduce, and a line the driver checks."""
import os

import torch
import torch.distributed as dist

import libddp_torch  # noqa: F401  (fills RANK and the rest from the launcher's variables)

dist.init_process_group("libddp")
r, w = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
print(f"LAUNCHED rank {r} world {w} RANK={os.environ['RANK']} "
      f"LOCAL_RANK={os.environ['LOCAL_RANK']} LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']} "
      f"sum {t.item():g}", flush=True)
dist.destroy_process_group()
