"""libddp as a torch.distributed backend (docs/torch.md).

    import libddp_torch                      # registers the backend "libddp"
    dist.init_process_group("libddp")        # instead of "gloo"

Every reduction adds the ranks' values in rank order, so a script's result is the same bit
for bit on shm and tcp and for any bucket layout; waits are bounded by the group's timeout;
a mismatched collective fails on every rank naming both calls; the flight recorder and
DDP_FAULT work as they do for ddp-train.

The transport is shared memory when every rank runs on one host, else tcp. Choose it with
    dist.init_process_group("libddp", pg_options=libddp_torch.Options(transport="tcp"))
or with DDP_BACKEND=shm|tcp in the environment (the option wins). On shm, DDP's gradient
buckets are made in the group's shared memory and reduced there in place (_Reducer;
Options(bucket_memory="ordinary") keeps them in ordinary memory).
"""

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from . import _C

__all__ = ["Options", "ProcessGroupLibddp", "TRANSPORTS", "ALGORITHMS", "monitored_barrier",
           "empty", "to_group_memory_", "in_group_memory", "allreduce_hook", "launcher_env"]

ProcessGroupLibddp = _C.ProcessGroupLibddp
TRANSPORTS = ("auto", "shm", "tcp", "gloo", "mpi")
ALGORITHMS = ("auto", "canonical", "ring", "small")


class Options:
    """The backend's options, passed as init_process_group(..., pg_options=Options(...)) or
    new_group(..., pg_options=...). A dict with the same keys is accepted too.

    transport: "auto" (shm on one host, tcp across hosts; DDP_BACKEND overrides auto),
               "shm", "tcp" ("gloo" is the same) or "mpi" (where libddp was built with it).
    algorithm: "auto", "canonical" (rank-order sums, the default for large messages),
               "small" (rank-order, latency-bound) or "ring" (gloo's ring: faster on
               slow links, deterministic run to run but not rank-order).
    defer_start: True (the default): a collective issued while the group is idle starts
               when its work is waited on (on the waiting thread), tested, or its future
               asked for (DDP's reducer and comm hooks ask at once), or else within 1 ms;
               a synchronous call then runs on the caller's thread with no hand-off to
               libddp's progress thread. False: collectives above 1 MiB (shm) or 256 KiB
               (tcp) start on the progress thread at once.
    bucket_memory: "group" (the default): DDP on a shm group builds its gradient buckets
               in the group's shared memory, so its reduction reads the peers' buckets in
               place (no staging copy); "ordinary": in ordinary memory, as gloo's. Nothing
               else changes: the sums and the bits are the same. tcp: always ordinary.
    """

    _KEYS = ("transport", "algorithm", "defer_start", "bucket_memory")
    _BUCKET_MEMORY = ("group", "ordinary")

    def __init__(self, transport="auto", algorithm="auto", defer_start=True,
                 bucket_memory="group"):
        if transport not in TRANSPORTS:
            raise ValueError(
                f"libddp: unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"libddp: unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if not isinstance(defer_start, bool):
            raise TypeError(f"libddp: defer_start must be True or False, not {defer_start!r}")
        if bucket_memory not in self._BUCKET_MEMORY:
            raise ValueError(f"libddp: unknown bucket_memory {bucket_memory!r}; choose one of "
                             f"{', '.join(self._BUCKET_MEMORY)}")
        self.transport = transport
        self.algorithm = algorithm
        self.defer_start = defer_start
        self.bucket_memory = bucket_memory

    @classmethod
    def of(cls, value):
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls._KEYS))
            if unknown:
                raise ValueError(
                    f"libddp: unknown backend option {unknown[0]!r}; the options are "
                    f"{', '.join(cls._KEYS)}")
            return cls(**value)
        raise TypeError(
            f"libddp: pg_options must be libddp_torch.Options or a dict, not "
            f"{type(value).__name__}")

    def __repr__(self):
        return (f"libddp_torch.Options(transport={self.transport!r}, "
                f"algorithm={self.algorithm!r}, defer_start={self.defer_start!r}, "
                f"bucket_memory={self.bucket_memory!r})")


def _timeout_ms(timeout):
    if isinstance(timeout, datetime.timedelta):
        return int(timeout.total_seconds() * 1000)
    return int(float(timeout) * 1000)


def _create(backend_opts, pg_options):
    """torch.distributed's creator for the backend (extended API)."""
    opts = Options.of(pg_options)
    source = "libddp_torch.Options" if opts.transport != "auto" else "auto"
    transport = "tcp" if opts.transport == "gloo" else opts.transport
    if backend_opts.store is None:
        raise ValueError("libddp: no store was given to the backend")
    # The flight recorder records the process's first group (the default group): every
    # group dumps under its own rank's file name, so a subgroup's dump would replace it.
    global _recording
    record, _recording = not _recording, True
    return _C.create(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                     _timeout_ms(backend_opts.timeout), transport, source, opts.algorithm,
                     record, opts.defer_start, opts.bucket_memory == "group")


_recording = False

# Before the interpreter finalizes, let every group's completer finish the futures it is
# completing (ProcessGroupLibddp::quiesce in process_group.hpp: otherwise a script whose last
# DDP step ran a Python comm hook can die at exit with "terminate called without an active
# exception"). Bounded, so that a collective stuck at exit cannot hold the process.
atexit.register(_C._quiesce, 10000)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """torch.distributed.monitored_barrier that a libddp group accepts: PyTorch 1.13's own
    function refuses every backend but gloo before it reaches the group ("monitored_barrier
    is only implemented for GLOO backend."), so importing libddp_torch puts this one in its
    place (torch.distributed.monitored_barrier is this function afterwards). Same arguments
    and defaults. On a libddp group, rank 0 waits up to timeout for every other rank and
    raises naming the ranks that did not arrive ("Rank 1 failed to pass monitoredBarrier in
    1000 ms"); any other group, and a rank outside the group, get PyTorch's function."""
    from torch.distributed import distributed_c10d as c10d
    pg = group if group is not None else c10d._get_default_group()
    if c10d._rank_not_in_group(group) or not isinstance(pg, ProcessGroupLibddp):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if timeout is None:
        timeout = c10d.default_pg_timeout
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def empty(*size, dtype=torch.float32, group=None):
    """An uninitialised tensor in the libddp group's communication memory, as torch.empty
    makes one in ordinary memory. On shm that memory is the shared segment every rank maps:
    a collective on such a tensor reads the peers' tensors in place, where one on an
    ordinary tensor copies it into the segment and back (docs/torch.md, "Tensors in the
    group's memory"); on tcp it is ordinary memory. The tensor keeps the group's memory
    alive after destroy_process_group until it is freed. group: a libddp group (default:
    the default group)."""
    pg = _libddp_group(group, "empty")
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    shape = torch.Size(size)
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return _C.alloc(pg, nbytes).view(dtype).view(shape)


def _libddp_group(group, what):
    from torch.distributed import distributed_c10d as c10d
    pg = group if group is not None else c10d._get_default_group()
    if not isinstance(pg, ProcessGroupLibddp):
        raise TypeError(f"libddp_torch.{what}: the group is a {type(pg).__name__}, not a libddp "
                        f"group (init_process_group(\"libddp\") or new_group(backend=\"libddp\"))")
    return pg


def to_group_memory_(tensor, group=None):
    """Moves the tensor's storage into the libddp group's communication memory, in place, as
    Tensor.share_memory_() moves one into shared memory: the values stay, and every tensor
    that views the storage follows, so collectives on any of them then read the peers' memory
    in place instead of copying through the staging area (docs/torch.md, "Tensors in the
    group's memory"). Returns the tensor. A no-op where the storage is there already, and on
    tcp, whose memory is ordinary memory. Raw pointers into the old storage (an array from
    tensor.numpy(), a data_ptr() kept aside) are left pointing at freed memory, as after
    share_memory_(). Raises when the storage is not the tensor's own (memory lent by numpy
    through torch.from_numpy, by from_blob or a shared mapping), is in another group's
    memory, or does not fit. group: a libddp group (default: the default group)."""
    pg = _libddp_group(group, "to_group_memory_")
    why = _C.move_to_group_memory(pg, tensor)
    if why:
        raise RuntimeError(f"libddp_torch.to_group_memory_: {why}")
    return tensor


def in_group_memory(tensor, group=None):
    """Whether the tensor's storage is in the libddp group's communication memory (from
    libddp_torch.empty or to_group_memory_)."""
    return _C.in_group_memory(_libddp_group(group, "in_group_memory"), tensor)


def allreduce_hook(process_group, bucket):
    """A DDP communication hook: PyTorch's default_hooks.allreduce_hook (each rank's bucket
    divided by the world size, then summed by all_reduce: the same arithmetic and the same
    bits) with the bucket's storage moved into the libddp group's memory the first time the
    hook sees it. DDP keeps its buckets from step to step (it builds them again once, after
    the first step), so from then on every bucket is reduced in place with no staging copy;
    with gradient_as_bucket_view=True the parameters' .grad, views of the buckets, move
    with them (docs/torch.md; docs/benchmarks.md, "The torch backend", for its speed).

        model.register_comm_hook(None, libddp_torch.allreduce_hook)

    process_group: the group to reduce on, as for PyTorch's hook (None: the default group;
    pass the model's group when it is another). On a group that is not libddp's, or when the
    group's memory cannot hold a bucket (warned once), it is PyTorch's hook unchanged."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    pg = process_group if process_group is not None else c10d._get_default_group()
    if isinstance(pg, ProcessGroupLibddp):
        why = _C.move_to_group_memory(pg, bucket.buffer())
        if why:
            import warnings  # once per message: Python's default filter
            warnings.warn(f"libddp_torch.allreduce_hook: bucket {bucket.index()} stays in "
                          f"ordinary memory and is reduced through the staging area: {why}",
                          RuntimeWarning)
    return default_hooks.allreduce_hook(process_group, bucket)


class _Reducer(dist.Reducer):
    """DDP's reducer (torch.distributed.Reducer, which DistributedDataParallel builds), with
    its gradient buckets made in the libddp group's shared memory when its group is a shm
    group with Options(bucket_memory="group"): while the reducer builds buckets (here and in
    _rebuild_buckets, after the first step) this thread's allocations come from the group's
    memory (module.cpp, BucketAllocator). DDP's default reduction then reads the peers'
    buckets in place instead of copying them through the staging area: the speed of
    allreduce_hook without a hook, and without moving any memory. On any other group it is
    PyTorch's reducer unchanged."""

    def __init__(self, *args, **kwargs):
        pg = kwargs["process_group"] if "process_group" in kwargs else (
            args[3] if len(args) > 3 else None)
        group = pg if isinstance(pg, ProcessGroupLibddp) and pg.bucket_memory == "group" else None
        with _buckets_of(group):
            super().__init__(*args, **kwargs)
        self._libddp_group = group

    def _rebuild_buckets(self):
        with _buckets_of(self._libddp_group):
            return super()._rebuild_buckets()


class _buckets_of:
    """This thread's allocations in the group's memory for the block (None: no change)."""

    def __init__(self, group):
        self.group = group

    def __enter__(self):
        if self.group is not None:
            _C._open_bucket_window(self.group)

    def __exit__(self, *exc):
        if self.group is not None:
            _C._close_bucket_window()


# Where an MPI or Slurm launcher puts rank and size, in the order Accelerate reads them;
# torch.distributed's env:// reads only RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.
_LAUNCHER_ENV = (
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ("mpiexec (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def launcher_env(environ=None):
    """Under mpirun, srun or an MPICH mpiexec, which set their own rank variables and not
    RANK, fill RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from them, so that
    init_process_group's default env:// works as under torchrun or ddprun (MASTER_ADDR and
    MASTER_PORT still come from the user: `mpirun -x MASTER_ADDR=host -x MASTER_PORT=port`).
    Runs at import; a variable already set is never changed. Returns the launcher's name, or
    None when RANK was set or no launcher is recognised."""
    env = os.environ if environ is None else environ
    if "RANK" in env:
        return None
    for name, rank, size, local_rank, local_size in _LAUNCHER_ENV:
        if rank in env and size in env:
            env["RANK"] = env[rank]
            env.setdefault("WORLD_SIZE", env[size])
            env.setdefault("LOCAL_RANK", env.get(local_rank, "0"))
            # Slurm's per-node count may read "2(x3)"; the leading count is this node's.
            env.setdefault("LOCAL_WORLD_SIZE", env.get(local_size, env[size]).split("(")[0])
            return name
    return None


def _register():
    if "LIBDDP" not in dist.Backend._plugins:
        dist.Backend.register_backend("libddp", _create, extended_api=True)


launcher_env()
_register()
# torch.distributed.monitored_barrier refuses every backend but gloo in 1.13's Python; this
# module's takes libddp groups and hands any other group to PyTorch's (monitored_barrier).
if dist.monitored_barrier.__module__ != __name__:
    _torch_monitored_barrier = dist.monitored_barrier
    dist.monitored_barrier = dist.distributed_c10d.monitored_barrier = monitored_barrier
# DistributedDataParallel builds its reducer as torch.distributed.Reducer(...): this one makes
# DDP's buckets in a shm group's memory (_Reducer).
if dist.Reducer.__module__ != __name__:
    dist.Reducer = _Reducer
