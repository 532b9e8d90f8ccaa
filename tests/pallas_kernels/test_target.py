"""Kernel dispatch follows the compile target (pallas_kernels.target), not the host's default backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from pallas_kernels.kda.ops import _resolve
from pallas_kernels.mla_attention.ops import resolve_implementation as mla_resolve
from pallas_kernels.moe.ops import resolve_implementation as moe_resolve
from pallas_kernels.target import Target, compile_for, current_target


def _abstract_mesh(kind: str, platform: str, cores=None):
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)


def _kda_args(dtype=jnp.bfloat16):
    x = jnp.zeros((1, 64, 2, 16), dtype)
    return dict(q=x, k=x, v=x, g=x.astype(jnp.float32), beta=jnp.zeros((1, 64, 2), jnp.float32), scale=0.25,
                initial_state=None, segment_ids=None, chunk_size=16, interpret=False)


def test_default_is_the_host_device():
    assert current_target().platform == jax.default_backend()


def test_abstract_mesh_device_decides():
    with jax.sharding.use_abstract_mesh(_abstract_mesh("TPU v5", "tpu", 2)):
        assert current_target() == Target("tpu", "TPU v5", 2, False)
        assert _resolve(None, False, _kda_args())[0] == "pallas-tpu"
        assert moe_resolve(None, False, None, jnp.bfloat16) == "tpu"
        assert mla_resolve(None, jnp.bfloat16) == "xla"  # no TPU flash kernel
    with jax.sharding.use_abstract_mesh(_abstract_mesh("NVIDIA H200", "gpu", 132)):
        target = current_target()
        assert target.hopper and target.cuda and target.num_cores == 132
        assert moe_resolve(None, False, None, jnp.bfloat16) == "gpu"
        assert mla_resolve(None, jnp.bfloat16) == "pallas"
    with jax.sharding.use_abstract_mesh(_abstract_mesh("NVIDIA A100-SXM4-80GB", "gpu", 108)):
        assert not current_target().hopper
        assert moe_resolve(None, False, None, jnp.bfloat16) == "xla"  # no Mosaic GPU kernel before Hopper


def test_concrete_mesh_of_host_devices_keeps_host_paths():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    with jax.set_mesh(mesh):
        assert current_target().platform == jax.default_backend()
        if jax.default_backend() == "cpu":
            assert moe_resolve(None, False, None, jnp.bfloat16) == "tiled"


def test_explicit_context_wins_over_the_mesh():
    with jax.sharding.use_abstract_mesh(_abstract_mesh("NVIDIA H200", "gpu", 132)):
        with compile_for("tpu"):
            assert current_target().platform == "tpu"
            assert moe_resolve("pallas", False, None, jnp.bfloat16) == "tpu"
    with compile_for("cpu"):
        with pytest.raises(ValueError, match="compiling for 'cpu'"):
            moe_resolve("pallas", False, None, jnp.bfloat16)
    with pytest.raises(ValueError, match="target must be"):
        with compile_for("npu"):
            pass


def test_tpu_kernels_refuse_float16():
    """The real Mosaic TPU compiler has no float16 vector loads: None falls back, "pallas" says why."""
    with compile_for("tpu"):
        assert _resolve(None, False, _kda_args(jnp.float16))[0] == "xla"
        with pytest.raises(ValueError, match="does not support these inputs"):
            _resolve("pallas", False, _kda_args(jnp.float16))
        assert moe_resolve(None, False, None, jnp.float16) == "xla"
        with pytest.raises(ValueError, match="tpu kernel needs bfloat16 inputs"):
            moe_resolve("pallas", False, None, jnp.float16)
