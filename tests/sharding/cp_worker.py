"""Multi-device context-parallel checks (run by test_cp.py in a subprocess with 8 CPU devices)."""

import re

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from pallas_kernels.kda import causal_conv1d, chunk_kda  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from sharding.cp import causal_conv1d_cp, chunk_kda_cp  # noqa: E402
from tests.sharding.multidevice import emit, value_error  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

B, H, K, C = 2, 2, 8, 8
COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(.*?"
    r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}"
)
PERMUTE = re.compile(r"=\s*(\S+)\s+collective-permute(?:-start)?\(")


def _segments(T):
    # Row 0: documents change mid-shard and exactly on a shard boundary (T/4); row 1: one document.
    t = jnp.arange(T)
    return jnp.stack([(t >= T // 4).astype(jnp.int32) + (t >= T // 2 + 3), jnp.zeros(T, jnp.int32)])


def _kda_inputs(T, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = unit(jax.random.normal(ks[0], (B, T, H, K))), unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, K))
    g = -0.5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, g, beta


def _fwd_grad(f, args):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(jnp.cos(y))


def _rel(a, b):
    return max(rel_rmse(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_kda(mesh):
    T = 64
    args, seg = _kda_inputs(T), _segments(T)
    ref = lambda *a: chunk_kda(*a, segment_ids=seg, chunk_size=C, implementation="xla")[0]
    y_ref, g_ref = _fwd_grad(ref, args)
    with use_mesh(mesh):
        y, g = jax.jit(lambda *a: _fwd_grad(lambda *b: chunk_kda_cp(*b, segment_ids=seg, chunk_size=C), a))(*args)
    return {"fwd": rel_rmse(y, y_ref), "grad": _rel(g, g_ref)}


def kda_collectives(mesh, T):
    """Shapes of every collective in the compiled forward+backward of chunk_kda_cp at length T."""
    args, seg = _kda_inputs(T), _segments(T)
    with use_mesh(mesh) as ctx:
        spec = ctx.sharding("batch", "length", "heads", "head_dim")
        shardings = (spec,) * 4 + (ctx.sharding("batch", "length", "heads"),)
        fn = lambda *a: _fwd_grad(lambda *b: chunk_kda_cp(*b, segment_ids=seg, chunk_size=C), a)
        text = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text()
    # the state pass's exchanges with neighbour shards (their HLO names pairs, not a mesh group)
    shapes = [f"{re.sub(r'{[^}]*}', '', shape)} collective-permute" for shape in PERMUTE.findall(text)]
    for m in COLLECTIVE.finditer(text):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(3)))
        axes = re.findall(r"'(\w+)'", m.group(4))
        if any(int(sizes[a]) > 1 for a in axes):  # a group of one device moves no bytes
            shapes.append(f"{re.sub(r'{[^}]*}', '', m.group(1))} {m.group(2)} {axes}")
    return sorted(shapes)


def check_conv(mesh):
    T = 32
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, H * K))
    w = jax.random.normal(jax.random.PRNGKey(2), (H * K, 4))
    seg = _segments(T)
    y_ref, g_ref = _fwd_grad(lambda x, w: causal_conv1d(x, w, segment_ids=seg)[0], (x, w))
    with use_mesh(mesh):
        y, g = jax.jit(lambda *a: _fwd_grad(lambda x, w: causal_conv1d_cp(x, w, segment_ids=seg), a))(x, w)
    return {"fwd": rel_rmse(y, y_ref), "grad": _rel(g, g_ref)}


def main():
    mesh = make_mesh(data=2, sequence=4)
    out = {"kda": check_kda(mesh), "conv": check_conv(mesh)}
    out["kda_seq8"] = check_kda(make_mesh(data=1, sequence=8))
    out["collectives_T64"] = kda_collectives(mesh, 64)
    out["collectives_T128"] = kda_collectives(mesh, 128)
    args, seg = _kda_inputs(40), _segments(40)
    with use_mesh(mesh):
        out["err_length"] = value_error(lambda: chunk_kda_cp(*args, segment_ids=seg, chunk_size=C))
    emit(out)


if __name__ == "__main__":
    main()
