"""Process setup for the whole suite, run before any test module imports JAX's CPU backend."""

import os

# XLA:CPU's intra-op thread pool (sized by PJRT_NPROC when the CPU client is created, else one
# thread per usable core) also runs host callbacks of the Mosaic GPU interpreter, and a barrier
# wait is a callback that blocks its pool thread until another warpgroup arrives. When the
# blocked callbacks (at most one per warpgroup, plus the kernel's own thread_map callback) fill
# the pool, the arriving warpgroup's work stays queued behind them: a deadlock, the interpreter's
# threads parked in tsl::BlockUntilReady (2-warpgroup KDA scans on a 1-thread pool: 7 of 8 runs).
# 8 threads keep free ones even for the 3-warpgroup MoE kernels (4 blocked callbacks).
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

# libtpu (the `tpu` extra) compiles for TPU slices on this host (tests/k3jax/plan): no GCE metadata
# server to ask, and several test processes may load it at once (its lockfile guards real chips).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
