"""Process setup for the whole suite, run before any test module imports JAX's CPU backend."""

import os

# XLA:CPU's intra-op thread pool (sized by PJRT_NPROC when the CPU client is created, else one
# thread per usable core) also runs the host callbacks of the Mosaic GPU interpreter, and a
# barrier wait is a callback that blocks its pool thread until another warpgroup arrives. With
# one blocked callback per warpgroup plus the kernel's own thread_map callback, a pool no larger
# than that leaves the arriving warpgroup's work queued behind them: a deadlock (seen with 2
# warpgroups on a 1-thread pool, the parked threads in tsl::BlockUntilReady). 8 threads cover
# the 3-warpgroup kernels with one to spare.
os.environ.setdefault("PJRT_NPROC", str(max(8, len(os.sched_getaffinity(0)))))
