"""MXFP4 codec: the value table, nibble order, exactness, and the release's own bytes."""

import numpy as np
import pytest

from k3jax.convert import mxfp4
from k3jax.convert.safetensors_io import SafetensorsReader

ORACLE = "/work/shared/oracle/tiny_a"


def test_decode_table_and_nibble_order():
    # Row 0: codes 0..15 in column order -> bytes (low nibble = even column).
    codes = np.arange(32, dtype=np.uint8) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)[None]  # [1, 16]
    scale = np.array([[127 + 1]], dtype=np.uint8)  # x2
    got = mxfp4.decode(packed, scale)
    table = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    np.testing.assert_array_equal(got[0, :16], 2 * np.array(table, np.float32))
    assert np.signbit(got[0, 8])  # code 8 is -0


def test_encode_decode_exact_on_representable_values():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(8, 64)).astype(np.uint8)
    scale = rng.integers(100, 150, size=(8, 2)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    w = mxfp4.decode(packed, scale)
    assert np.array_equal(mxfp4.decode(*mxfp4.encode(w)), w)


def test_encode_rounds_to_nearest_even_and_saturates():
    w = np.zeros((1, 32), np.float32)
    w[0, :6] = [6.0, 0.25, 0.75, 2.5, 5.0, -1.25]  # amax 6 -> scale 2^0
    got = mxfp4.decode(*mxfp4.encode(w))[0, :6]
    # ties: 0.25 -> 0 (even), 0.75 -> 1, 2.5 -> 2, 5 -> 4, -1.25 -> -1
    np.testing.assert_array_equal(got, [6.0, 0.0, 1.0, 2.0, 4.0, -1.0])
    w[0, 0] = 7.0  # amax 7 -> scale 2^0 as well (floor(log2 7) - 2 = 0), saturates at 6
    assert mxfp4.decode(*mxfp4.encode(w))[0, 0] == 6.0


def test_encode_reproduces_release_bytes():
    """Every expert of the oracle's hf_mxfp4 is re-encoded byte for byte from hf_bf16."""
    bf16, packed = SafetensorsReader(f"{ORACLE}/hf_bf16"), SafetensorsReader(f"{ORACLE}/hf_mxfp4")
    keys = [k for k in bf16.keys() if ".experts." in k]
    assert len(keys) == 9 * 16 * 3
    for key in keys:
        base = key.removesuffix("weight")
        p, s = mxfp4.encode(bf16.get(key).astype(np.float32), name=key)
        assert np.array_equal(p, packed.get(base + "weight_packed")), key
        assert np.array_equal(s, packed.get(base + "weight_scale")), key


@pytest.mark.parametrize("packed, scale, match", [
    (np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8), "weight_scale shape"),
    (np.zeros((2, 16), np.int8), np.zeros((2, 1), np.uint8), "uint8"),
    (np.zeros((2, 16), np.uint8), np.full((2, 1), 255, np.uint8), "NaN"),
])
def test_decode_rejects_bad_input(packed, scale, match):
    with pytest.raises(ValueError, match=match):
        mxfp4.decode(packed, scale, name="w1")


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.encode(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="finite"):
        mxfp4.encode(np.full((2, 32), np.inf, np.float32))
