"""hf-to-orbax and restore on 8 fake CPU devices, mesh data=2 x expert=4 (run by test_convert_sharded.py).

Prints per variant: the bytes read from the checkpoint against its size (each block read once,
replicas included), whether the restored leaves equal ``load_hf`` bit for bit and carry the
model's shardings, and (``K3JAX_CONVERT_LOGITS=1``) whether the forward on the restored sharded
tree gives the logits of ``load_hf``'s tree placed on the same mesh, bit for bit. The same for
``hf_mxfp4`` stored in the scanned layout (``hf_mxfp4_scanned``), restored as stacked arrays.
"""

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.convert import load_hf
from k3jax.convert.convert import hf_to_orbax
from k3jax.convert.orbax_ckpt import mesh_shardings, restore_orbax
from k3jax.layout import to_per_layer
from k3jax.convert.sharded_read import HFSource
from tests.sharding.multidevice import emit

ORACLE = "/work/shared/oracle/tiny_a"


def _flat(tree) -> dict:
    return {tuple(str(k.key) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _logits_equal(cfg, mesh, restored, loaded) -> dict:
    import flax.linen as nn

    from k3jax.model import Transformer
    from sharding import logical_axes, shard_params, use_mesh

    # The oracle's 2 rows, repeated so the batch splits over the mesh's 8 batch shards.
    tokens = jnp.asarray(np.tile(np.load(f"{ORACLE}/reference.npz")["input_ids"], (4, 1)), jnp.int32)
    model = Transformer(cfg)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    placed = shard_params(loaded, logical_axes(boxed), mesh)
    forward = jax.jit(lambda v, t: model.apply(v, t))
    with use_mesh(mesh):
        a, b = np.asarray(forward(restored, tokens)), np.asarray(forward(placed, tokens))
    single = np.asarray(jax.jit(lambda v, t: model.apply(v, t))(jax.device_put(loaded, jax.devices()[0]), tokens))
    return {"logits_identical": bool(np.array_equal(a, b)),
            "vs_single_device_max_abs": float(np.max(np.abs(a.astype(np.float32) - single.astype(np.float32))))}


def main() -> None:
    from sharding import make_mesh

    mesh = make_mesh(data=2, expert=4)
    out = {}
    for variant in ("hf_bf16", "hf_mxfp4"):
        path = f"{ORACLE}/{variant}"
        dst = os.path.join(tempfile.mkdtemp(), "orbax")
        source = HFSource(path)
        hf_to_orbax(path, dst, mesh=mesh, source=source, group_bytes=1 << 18)
        size = sum(i.end - i.begin for i in source.reader.infos.values())
        cfg, restored = restore_orbax(dst, shardings=mesh)
        _, loaded = load_hf(path, param_dtype=jnp.bfloat16)
        want = mesh_shardings(cfg, mesh)  # of the stored per-layer leaves
        r, l = _flat(to_per_layer(restored, cfg)), _flat(to_per_layer(loaded, cfg))
        w1 = to_per_layer(restored, cfg)["params"]["layers_1"]["moe"]["w1"]
        out[variant] = {
            "bytes_read": source.bytes_read, "checkpoint_bytes": size,
            "bitwise": r.keys() == l.keys() and all(
                np.asarray(r[k]).tobytes() == np.asarray(l[k]).tobytes() and r[k].dtype == l[k].dtype for k in l),
            "shardings": all(r[k].sharding.is_equivalent_to(want[k], r[k].ndim) for k in r),
            "w1_spec": str(w1.sharding.spec), "w1_shard_shape": list(w1.addressable_shards[0].data.shape),
        }
        if os.environ.get("K3JAX_CONVERT_LOGITS") == "1" and variant == "hf_mxfp4":
            out[variant].update(_logits_equal(cfg, mesh, restored, loaded))
    out["hf_mxfp4_scanned"] = _scanned(mesh)
    emit(out)


def _scanned(mesh) -> dict:
    """``--layout scanned`` on the mesh: stacked leaves read shard by shard, restored as they are
    stored (the scanned model's layout) with the scanned model's shardings."""
    path = f"{ORACLE}/hf_mxfp4"
    dst = os.path.join(tempfile.mkdtemp(), "orbax")
    source = HFSource(path)
    hf_to_orbax(path, dst, mesh=mesh, source=source, group_bytes=1 << 18, layout="scanned")
    cfg, restored = restore_orbax(dst, shardings=mesh, layout="scanned")
    _, loaded = load_hf(path, param_dtype=jnp.bfloat16)
    want = mesh_shardings(cfg, mesh, "scanned")
    r, l = _flat(restored), _flat(loaded)
    w1 = restored["params"]["stack_1"]["offset_0"]["moe"]["w1"]
    return {"bytes_read": source.bytes_read,
            "bitwise": r.keys() == l.keys() and all(np.asarray(r[k]).tobytes() == np.asarray(l[k]).tobytes() for k in l),
            "shardings": all(r[k].sharding.is_equivalent_to(want[k], r[k].ndim) for k in r),
            "w1_spec": str(w1.sharding.spec), "w1_shard_shape": list(w1.addressable_shards[0].data.shape)}


if __name__ == "__main__":
    main()
