"""Devices to compile for without owning them: TPU pod slices through libtpu, H200 hosts through
XLA's CUDA compiler, and the datasheet numbers of each chip.

TPU names are libtpu's, ``<generation>:<chips>`` (``v5p:16x16x1``, ``v5e:16x16``, ``v6e:16x16``,
``tpu7x:4x4x4``); ``jax.experimental.topologies.get_topology_desc`` turns one into compile-only
devices on this CPU host (MaxText's ``train_compile.py`` does the same). GPU names are
``h200:<hosts>x<gpus per host>`` (``h200:1x8``, ``h200:32x8``): a device-less CUDA topology from a
hand-written H200 target description, which needs the ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``
wheels of the pinned jax (no GPU, no CUDA driver). Unknown names raise ``ValueError`` with the
accepted forms; libtpu's own error never reaches the user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import jax


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-device datasheet numbers: HBM bytes, dense bf16 FLOP/s, HBM bytes/s, and the bytes/s one
    device sends over its fastest links (ICI or NVLink, all links together, one direction)."""

    name: str
    hbm: float
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float


# Vendor datasheets (Google Cloud TPU system architecture pages, NVIDIA H200 datasheet). A TPU7x
# device is one of the chip's two TensorCore dies (libtpu lists 2 devices per chip): half its
# 192 GB, 2,307 dense bf16 TFLOP/s and 7.37 TB/s. v5p's 95 is GiB (96 GiB physical, 1 GiB kept by the
# runtime: the page's own footnote); its compiler refuses programs above 95.73 GiB.
CHIPS: dict[str, Chip] = {
    "v5p": Chip("TPU v5p", 95 * 2**30, 459e12, 2.765e12, 4800e9 / 8 / 2),
    "v5e": Chip("TPU v5e", 16e9, 197e12, 0.819e12, 1600e9 / 8 / 2),
    "v6e": Chip("TPU v6e", 32e9, 918e12, 1.64e12, 3584e9 / 8 / 2),
    "tpu7x": Chip("TPU7x (one die)", 96e9, 1153.5e12, 3.685e12, 1.2e12 / 2 / 2),
    "h200": Chip("NVIDIA H200", 141e9, 989e12, 4.8e12, 450e9),
}

_TPU_NAME = re.compile(r"^(v5p|v5e|v6e|tpu7x):(\d+(x\d+){1,2})$")
_GPU_NAME = re.compile(r"^h200:(\d+)x(\d+)$")

H200_TARGET = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 } runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200" """


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    chip: Chip
    devices: tuple
    gpu_hosts: int = 0  # H200 hosts; 0 for a TPU slice

    @property
    def needs_buffer_readout(self) -> bool:
        """Whether only the buffer assignment gives per-device memory: jax 0.11.2's
        ``memory_analysis()`` of a multi-host GPU program counts its arguments unsharded."""
        return self.gpu_hosts > 1


def _bad_name(name: str) -> ValueError:
    return ValueError(
        f"topology={name!r} is not a known topology: use a TPU slice '<v5p|v5e|v6e|tpu7x>:<chips>' "
        "(v5p:2x2x1, v5p:16x16x1, v5e:16x16, v6e:16x16, tpu7x:4x4x4) or H200 hosts 'h200:<hosts>x<gpus>' "
        "(h200:1x8, h200:32x8)")


def _tpu_devices(name: str) -> tuple:
    # libtpu reads these when it loads: no GCE metadata server here, and several planner or test
    # processes may hold libtpu at once (its lockfile is for real chips).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401  (the compiler itself; `pip install -e '.[tpu]'`)
    except ImportError as err:
        raise ValueError(f"topology={name!r} needs libtpu: pip install 'libtpu==0.0.48.*' "
                         "(the version jax 0.11.2 pins), or `pip install -e '.[tpu]'`") from err
    from jax.experimental import topologies

    try:
        return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as err:  # libtpu's INVALID_ARGUMENT: a shape its host layout does not allow
        raise ValueError(f"topology={name!r}: libtpu has no such slice ({str(err).splitlines()[0][:200]}); "
                         "chip counts are per axis, e.g. v5p:2x2x1, v5e:2x2, v6e:4x4, tpu7x:2x2x1") from err


def _gpu_devices(name: str, hosts: int, per_host: int) -> tuple:
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"topology={name!r} needs XLA's CUDA compiler on this host: pip install "
            f"'jax-cuda12-plugin=={jax.__version__}' 'jax-cuda12-pjrt=={jax.__version__}' (no GPU or driver needed)"
        ) from err
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                        topology=f"1x{hosts}x{per_host}")
    return tuple(topo.devices)


def get_topology(name: str) -> Topology:
    """Compile-only devices and chip numbers for a topology name (see the module docstring)."""
    if m := _TPU_NAME.match(name):
        return Topology(name, CHIPS[m.group(1)], _tpu_devices(name))
    if m := _GPU_NAME.match(name):
        hosts, per_host = int(m.group(1)), int(m.group(2))
        if not (hosts >= 1 and 1 <= per_host <= 8):
            raise ValueError(f"topology={name!r}: an H200 host has 1 to 8 GPUs and there must be >= 1 host")
        return Topology(name, CHIPS["h200"], _gpu_devices(name, hosts, per_host), gpu_hosts=hosts)
    raise _bad_name(name)


@contextlib.contextmanager
def not_cached():
    """Write no program compiled inside to jax's persistent compilation cache. jax writes a program compiled for
    compile-only devices like any other but cannot load it back without a client of that platform, so with a cache on
    every later run warned ("Error reading persistent compilation cache entry … PjRtCompiler must be constructed with
    a Client") and compiled it again."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
