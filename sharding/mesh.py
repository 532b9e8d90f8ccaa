"""Device meshes with named axes: data, fsdp, expert, sequence, tensor.

The mesh always carries all five axes (size-1 axes cost nothing), ordered from the slowest
network to the fastest: ``data`` spans hosts (pure replication of the step, one gradient
all-reduce), ``tensor`` stays inside a host (a collective per matmul). Model code never sees
these names; it names logical axes and ``sharding.rules`` maps them here.
"""

from __future__ import annotations

import logging
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

logger = logging.getLogger(__name__)

AXES = ("data", "fsdp", "expert", "sequence", "tensor")

# Environment variables whose presence means "this process is one of several".
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "K3JAX_COORDINATOR_ADDRESS")


def _multi_process_env() -> bool:
    """True when the launcher says this is one process of a multi-process job."""
    if any(os.environ.get(name) for name in _MULTI_PROCESS_ENV):
        return True
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        if int(os.environ.get(name, "1") or "1") > 1:
            return True
    # A TPU pod slice lists every worker's hostname.
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def maybe_initialize_distributed() -> bool:
    """Call ``jax.distributed.initialize()`` once when the environment describes several processes.

    Must run before the first JAX computation. ``jax.distributed.initialize`` reads the cluster
    from the environment itself (TPU pod metadata, SLURM, Open MPI, or ``JAX_COORDINATOR_ADDRESS``
    / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``). Returns whether JAX is now multi-process.
    """
    if jax.distributed.is_initialized():
        return True
    if not _multi_process_env():
        return False
    address = os.environ.get("K3JAX_COORDINATOR_ADDRESS")
    if address:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["K3JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["K3JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    logger.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True


def resolve_axis_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Replace one ``-1`` by "the rest of the devices" and check the product equals ``num_devices``."""
    bad = {name: size for name, size in sizes.items() if size == 0 or size < -1}
    if bad:
        raise ValueError(f"mesh axis sizes {bad} must be positive or -1 (the rest)")
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {rest}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if num_devices % known:
            raise ValueError(
                f"mesh axis sizes {sizes}: the fixed axes multiply to {known}, which does not divide "
                f"the {num_devices} devices"
            )
        sizes = {**sizes, rest[0]: num_devices // known}
    elif known != num_devices:
        raise ValueError(
            f"mesh axis sizes {sizes} multiply to {known} but there are {num_devices} devices"
        )
    return sizes


def _device_grid(shape: tuple[int, ...], devices) -> np.ndarray:
    """Devices arranged so the inner axes stay on the fastest links."""
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        slices = len({getattr(d, "slice_index", 0) for d in devices})
        if slices > 1:
            # Several TPU slices talk over the data-centre network: only the outermost (data)
            # axis may span slices; everything else stays on one slice's ICI.
            if shape[0] % slices:
                raise ValueError(f"data={shape[0]} must be a multiple of the {slices} TPU slices")
            ici = (shape[0] // slices,) + shape[1:]
            dcn = (slices,) + (1,) * (len(shape) - 1)
            return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    # GPU / CPU: jax.devices() is process-major, so the outer (data) axis spans hosts and the
    # inner axes stay on one host's NVLink.
    return np.asarray(devices, dtype=object).reshape(shape)


def make_mesh(
    data: int = -1,
    expert: int = 1,
    sequence: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    devices=None,
) -> Mesh:
    """A mesh over ``devices`` (default: every device of every process) with axes ``AXES``.

    One axis may be ``-1`` (the rest). Multi-host jobs are initialised first (see
    :func:`maybe_initialize_distributed`). Axes are ``AxisType.Auto``: XLA's partitioner
    places the collectives, and ``shard_map`` takes over inside the EP/CP functions.
    """
    if devices is None:
        maybe_initialize_distributed()
        devices = jax.devices()
    devices = list(devices)
    sizes = resolve_axis_sizes(
        dict(data=data, fsdp=fsdp, expert=expert, sequence=sequence, tensor=tensor), len(devices)
    )
    shape = tuple(sizes[name] for name in AXES)
    grid = _device_grid(shape, devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh: Mesh, name: str) -> int:
    """Size of a mesh axis; 1 when the mesh lacks it."""
    return int(mesh.shape.get(name, 1))
