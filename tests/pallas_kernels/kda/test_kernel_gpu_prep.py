"""Mosaic GPU intra-chunk prep kernel == the XLA prep (``kernel_gpu_intra``), output by output.

Runs in the CPU interpreter (default suite, tiny sizes) and compiled on the H200 (``-m gpu``).
Several batches and heads so the kernel's token-major reads (``[B,T,H,.]`` sliced per head) are
covered; documents mid-chunk and a padded last chunk.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda.kernel_gpu_intra import prepare_from_index
from pallas_kernels.kda.kernel_gpu_prep import CHUNK, prepare_fused
from pallas_kernels.kda.reference import segment_index
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import BF16_FWD_RTOL, rel_rmse

MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]
NAMES = ("w", "u", "qg", "kg", "aqk", "d")


CASES = [
    (2, 100, 2, 128, 128, (30, 1, 69)),  # 2 chunks, documents mid-chunk, padded last chunk
    (1, 64, 3, 64, 128, None),  # K != V, one full chunk
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "B,T,H,K,V,lengths",
    [
        (2, 100, 2, 128, 128, (30, 1, 69)),  # 2 chunks, documents mid-chunk, padded last chunk
        (1, 64, 3, 64, 128, None),  # K != V, one full chunk
    ],
)
def test_prep_outputs_match_xla(interpret, B, T, H, K, V, lengths):
    q, k, v, g, beta, _ = kda_inputs(7, B, T, H, K, V, dtype=jnp.float32, state=False)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    seg = None if lengths is None else jnp.stack([segments_from_lengths(lengths)] * B)
    sidx = segment_index(seg, B, T)
    scale = K**-0.5
    got = jax.jit(lambda *a: prepare_fused(*a, sidx.astype(jnp.float32), scale, interpret))(q, k, v, g, beta)
    want = prepare_from_index(q, k, v, g, beta, sidx, scale=scale, chunk=CHUNK)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = rel_rmse(a, b)
        assert err <= BF16_FWD_RTOL, f"{name}: rel RMSE {err:.3e}"
