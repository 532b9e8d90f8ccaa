"""The hardware a kernel op is being compiled for, so that ``implementation=None`` follows the target.

Ahead-of-time compilation traces on a CPU host for devices that are not there: a TPU pod slice from
``jax.experimental.topologies.get_topology_desc`` or a device-less CUDA GPU. Asking
``jax.default_backend()`` then answers "cpu", and the ops would refuse their TPU or GPU kernels.
The target is, first match wins:

1. an explicit :func:`compile_for` context (``with compile_for("tpu"): jax.jit(f).lower(...)``);
2. the device of the mesh in context: ``jax.set_mesh(mesh)`` (``sharding.use_mesh`` sets it),
   ``jax.sharding.use_abstract_mesh``, and every ``shard_map`` body, whose abstract mesh carries the
   device kind of the mesh it was built from;
3. the default device (``jax.devices()[0]``): a plain ``jax.jit`` on this host.

Read at trace time: the context around ``.lower()`` / the first call decides, as for meshes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Iterator

import jax

# Device kinds of NVIDIA's Hopper generation (compute capability 9.0), whose Mosaic GPU kernels
# (wgmma, TMA) the GPU paths need: H100 / H200 / H800 / H20 and the Grace Hopper GH200.
_HOPPER_KIND = re.compile(r"\bG?H(100|200|800|20)\b")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Target:
    """One kind of device: ``platform`` is "cpu", "gpu" or "tpu"; ``device_kind`` as JAX reports it
    ("TPU v5", "NVIDIA H200", "cpu"); ``num_cores``: TPU cores or GPU streaming multiprocessors
    per device (None when unknown); ``cuda``: an NVIDIA GPU (not ROCm)."""

    platform: str
    device_kind: str
    num_cores: int | None = None
    cuda: bool = False

    @property
    def hopper(self) -> bool:
        """An NVIDIA Hopper GPU (sm_90): the Mosaic GPU kernels' hardware."""
        return self.platform == "gpu" and self.cuda and bool(_HOPPER_KIND.search(self.device_kind))


_EXPLICIT: contextvars.ContextVar[Target | None] = contextvars.ContextVar("pallas_kernels_target", default=None)


def _platform(name: str) -> str:
    return "gpu" if name in _GPU_PLATFORMS else name


def from_device(device) -> Target:
    """The target of a concrete (or compile-only) ``jax.Device``."""
    platform = _platform(device.platform)
    cores = getattr(device, "num_cores" if platform == "tpu" else "core_count", None)
    version = getattr(getattr(device, "client", None), "platform_version", "") or ""
    cuda = platform == "gpu" and (device.platform == "cuda" or "cuda" in version.lower()
                                  or "NVIDIA" in device.device_kind)
    return Target(platform, device.device_kind, cores, cuda)


def _from_abstract(device) -> Target:
    platform = _platform(device.platform)
    cuda = platform == "gpu" and (device.platform == "cuda" or "NVIDIA" in device.device_kind)
    return Target(platform, device.device_kind, device.num_cores, cuda)


def current_target() -> Target:
    """The device kind the code being traced is compiled for (see the module docstring)."""
    explicit = _EXPLICIT.get()
    if explicit is not None:
        return explicit
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None:
        return _from_abstract(device)
    platform, device = _platform(jax.default_backend()), jax.devices()[0]
    return from_device(device) if _platform(device.platform) == platform else Target(platform, platform)


@contextlib.contextmanager
def compile_for(target: str | Target | jax.Device) -> Iterator[Target]:
    """Trace kernel ops inside for ``target``: a platform name ("tpu", "gpu", "cpu"), a device
    (e.g. ``topology.devices[0]``) or a :class:`Target`. Overrides the mesh and the default device.
    A bare "gpu" names no device kind, so it selects no Hopper-only kernel: pass the device or a
    ``Target`` for those."""
    if isinstance(target, str):
        if _platform(target) not in ("cpu", "gpu", "tpu"):
            raise ValueError(f"target must be 'cpu', 'gpu' or 'tpu' (or a device), got {target!r}")
        target = Target(_platform(target), target, cuda=target in ("gpu", "cuda"))
    elif not isinstance(target, Target):
        target = from_device(target)
    token = _EXPLICIT.set(target)
    try:
        yield target
    finally:
        _EXPLICIT.reset(token)


__all__ = ["Target", "compile_for", "current_target", "from_device"]
