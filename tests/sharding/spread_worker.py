"""``map_matrices`` on 8 CPU devices (run by test_spread.py in a subprocess)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

jax.config.update("jax_default_matmul_precision", "highest")

from k3jax.train.optimizer import MuonDimensionNumbers, _orthogonalize, newton_schulz  # noqa: E402
from sharding import EXPERT, make_mesh, map_matrices, use_mesh  # noqa: E402
from tests.sharding.multidevice import emit  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

COEFFS = jnp.array([3.4445, -4.7750, 2.0315])


def main():
    mesh = make_mesh(data=1, expert=2, fsdp=4)
    # 2 layers × 6 experts: 3 experts a rank, 6 matrices a shard over 4 fsdp ranks (padded to 8)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16, 8))
    names = ("layers", "experts", "latent", "expert_mlp")
    x = jax.device_put(x, NamedSharding(mesh, P(None, "expert", "fsdp", None)))
    one = lambda m: newton_schulz(m, COEFFS, 5, 1e-7, jnp.float32)
    want = jax.vmap(jax.vmap(one))(x)
    with use_mesh(mesh, EXPERT):
        got = jax.jit(lambda x: map_matrices(one, x, names))(x)
        dims = MuonDimensionNumbers(reduction_axis=(2,), output_axis=(3,))
        muon = jax.jit(lambda x: _orthogonalize(x, COEFFS, 5, 1e-7, dims, "bfloat16", names))(x)
    plain = _orthogonalize(x, COEFFS, 5, 1e-7, dims, "bfloat16")
    emit({"max_abs": float(jnp.max(jnp.abs(got - want))), "spec": str(got.sharding.spec),
          "muon_rel_rmse": float(rel_rmse(muon, plain)), "muon_spec": str(muon.sharding.spec),
          "none_without_mesh": map_matrices(one, x, names) is None})


if __name__ == "__main__":
    main()
