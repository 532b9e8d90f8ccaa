"""One of two processes under jax.distributed converting and restoring the oracle
(run by test_convert_sharded.py; 4 fake CPU devices each, mesh expert=8 across both).

Argument: the output folder (shared by both processes). Prints this process's bytes read per
variant and whether its restored shards equal ``load_hf``'s values at their indices, bit for bit.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.convert import load_hf
from k3jax.convert.convert import hf_to_orbax
from k3jax.convert.orbax_ckpt import restore_orbax
from k3jax.convert.sharded_read import HFSource
from sharding import make_mesh
from tests.sharding.multidevice import emit

ORACLE = "/work/shared/oracle/tiny_a"


def _shards_match(restored, loaded) -> bool:
    pairs = zip(jax.tree.leaves(restored), jax.tree.leaves(loaded))
    return all(np.asarray(s.data).tobytes() == np.asarray(want)[s.index].tobytes()
               for got, want in pairs for s in got.addressable_shards)


def main(out_dir: str) -> None:
    mesh = make_mesh(data=1, expert=8)  # initialises jax.distributed from K3JAX_* variables
    out = {"process": jax.process_index(), "processes": jax.process_count()}
    for variant in ("hf_bf16", "hf_mxfp4"):
        path = f"{ORACLE}/{variant}"
        dst = os.path.join(out_dir, variant)
        source = HFSource(path)
        hf_to_orbax(path, dst, mesh=mesh, source=source, group_bytes=1 << 19)
        _, restored = restore_orbax(dst, shardings=mesh)
        _, loaded = load_hf(path, param_dtype=jnp.bfloat16)
        out[variant] = {"bytes_read": source.bytes_read, "shards_match": _shards_match(restored, loaded)}
    emit(out)


if __name__ == "__main__":
    main(sys.argv[1])
