"""Worker (8 fake CPU devices): MLA's flash attention under data / tensor-parallel meshes == unsharded.

Run by tests/k3jax/test_attention.py through tests/sharding/multidevice.py; the kernels run in
the Pallas interpreter.
"""

import jax
import jax.numpy as jnp

from k3jax.layers import attention as attention_lib
from pallas_kernels.mla_attention import mla_attention
from sharding import use_mesh
from sharding.mesh import make_mesh
from tests.sharding.multidevice import emit
from tests.tolerances import rel_rmse



def main():
    B, T, H = 8, 24, 4
    ks = jax.random.split(jax.random.key(0), 6)
    shapes = [(B, T, H, 16), (B, T, H, 16), (B, T, H, 16), (B, T, 16), (B, T, H, 16)]
    args = [jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16) for k, s in zip(ks, shapes)]
    seg = jnp.ones((B, T), jnp.int32).at[::2, 10:].set(2)
    w = jax.random.normal(ks[5], (B, T, H, 16), jnp.float32)

    def run(fn):
        loss = lambda *a: jnp.sum(fn(*a)[0] * w)
        (o, mx), grads = jax.jit(fn)(*args), jax.jit(jax.grad(loss, argnums=range(5)))(*args)
        return [o, mx, *grads]

    want = run(lambda *a: mla_attention(*a, seg, scale=0.25, implementation="pallas", interpret=True))
    results = {}
    for name, sizes in {"data8": dict(data=8), "data4_tensor2": dict(data=4, tensor=2)}.items():
        with use_mesh(make_mesh(**sizes)):
            got = run(lambda *a: attention_lib.flash_attention(*a, seg, scale=0.25, interpret=True))
        errors = [rel_rmse(g, x) for g, x in zip(got, want)]
        # d k_rope sums over heads: per head shard in fp32, then across shards in bf16 (one rounding more).
        results[name] = {"exact": max(errors[:5] + errors[6:]), "dk_rope": errors[5]}
    emit(results)


if __name__ == "__main__":
    main()
