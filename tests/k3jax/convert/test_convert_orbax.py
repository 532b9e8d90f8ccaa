"""HF <-> orbax conversion on the real tiny K3 (shared/oracle/tiny_a): restore == load_hf bit for bit
(and the same logits), HF -> orbax -> HF byte-identical per tensor (MXFP4 included), the CLI, and
interrupted conversions. Bad inputs: test_convert_bad_input.py; sharded / multi-process: the
worker tests."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as C
from k3jax.convert import convert as conv
from k3jax.convert import load_hf
from k3jax.convert.__main__ import main
from k3jax.convert.orbax_ckpt import METADATA, is_orbax_checkpoint, read_metadata, restore_orbax
from k3jax.convert.safetensors_io import SafetensorsReader
from k3jax.model import Transformer
from k3jax.train.config import from_dict, to_dict

ORACLE = "/work/shared/oracle/tiny_a"
VARIANTS = ("hf_bf16", "hf_mxfp4")


def _bits(tree) -> dict:
    return {jax.tree_util.keystr(p): (np.asarray(x).dtype, np.asarray(x).tobytes())
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each oracle variant converted once through the CLI (small groups: several orbax writes)."""
    out = {}
    for variant in VARIANTS:
        dst = tmp_path_factory.mktemp("orbax") / variant
        assert main(["hf-to-orbax", f"{ORACLE}/{variant}", str(dst), "--group-mb", "0.25", "--no-progress"]) == 0
        out[variant] = dst
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_restore_equals_load_hf_bitwise(converted, variant):
    cfg, variables = restore_orbax(converted[variant])
    want_cfg, want = load_hf(f"{ORACLE}/{variant}", param_dtype=jnp.bfloat16)
    assert cfg == want_cfg
    assert _bits(variables) == _bits(want)
    meta = read_metadata(converted[variant])
    assert (meta["layout"], meta["dtype"], meta["source"]["mxfp4"]) == ("per-layer", "bfloat16", variant == "hf_mxfp4")


@pytest.mark.slow  # compiling tiny_a's forward takes a minute on 2 cores; the bitwise test above implies it
def test_restored_logits_identical_to_load_hf(converted):
    tokens = jnp.asarray(np.load(f"{ORACLE}/reference.npz")["input_ids"], jnp.int32)
    cfg, restored = restore_orbax(converted["hf_mxfp4"])
    _, loaded = load_hf(f"{ORACLE}/hf_mxfp4", param_dtype=jnp.bfloat16)
    forward = jax.jit(lambda v, t: Transformer(cfg).apply(v, t))
    assert np.array_equal(np.asarray(forward(restored, tokens)), np.asarray(forward(loaded, tokens)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_orbax_hf_byte_identical(converted, tmp_path, variant):
    back = tmp_path / "hf"
    assert main(["orbax-to-hf", str(converted[variant]), str(back), "--no-progress"]) == 0
    a, b = SafetensorsReader(f"{ORACLE}/{variant}"), SafetensorsReader(str(back))
    assert a.keys() == b.keys()
    for key in a.keys():
        assert a.get(key).dtype == b.get(key).dtype, key
        assert a.get(key).tobytes() == b.get(key).tobytes(), key
    assert "k3jax_overrides" not in json.loads((back / "config.json").read_text())["text_config"]


def test_float32_conversion_keeps_values(tmp_path):
    dst = tmp_path / "f32"
    conv.hf_to_orbax(f"{ORACLE}/hf_bf16", str(dst), dtype=jnp.float32)
    _, variables = restore_orbax(dst)
    assert _bits(variables) == _bits(load_hf(f"{ORACLE}/hf_bf16", param_dtype=jnp.float32)[1])


def test_cli_refuses_existing_dst_and_overwrites_on_request(converted, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("x")
    assert main(["hf-to-orbax", f"{ORACLE}/hf_bf16", str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: DST=") and "--overwrite" in err[0]
    assert (dst / "keep").exists()
    assert main(["hf-to-orbax", f"{ORACLE}/hf_bf16", str(dst), "--overwrite", "--no-progress"]) == 0
    assert is_orbax_checkpoint(dst) and not (dst / "keep").exists()
    assert main(["orbax-to-hf", str(converted["hf_bf16"]), str(dst), "--no-progress"]) == 2
    with pytest.raises(ValueError, match="already exists"):
        main(["--debug", "orbax-to-hf", str(converted["hf_bf16"]), str(dst), "--no-progress"])


def test_progress_bar_counts_tensors_and_bytes(tmp_path, capsys):
    assert main(["hf-to-orbax", f"{ORACLE}/hf_bf16", str(tmp_path / "o"), "--group-mb", "0.5"]) == 0
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    n = read_metadata(tmp_path / "o")["tensors"]
    assert f"{n}/{n} tensors" in final and "100%" in final and "B/s" in final, final


def test_interrupted_conversion_leaves_no_checkpoint(tmp_path):
    """A conversion cut short after its first orbax write leaves no DST; the next run completes."""
    dst = tmp_path / "cut"

    def crash(tensors, nbytes):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conv.hf_to_orbax(f"{ORACLE}/hf_mxfp4", str(dst), group_bytes=1 << 18, progress=crash)
    assert not dst.exists() and not is_orbax_checkpoint(dst)
    with pytest.raises(ValueError, match="interrupted conversion"):
        restore_orbax(dst)
    assert any(p.name.startswith("cut.incomplete") for p in tmp_path.iterdir())  # the debris, never DST
    conv.hf_to_orbax(f"{ORACLE}/hf_mxfp4", str(dst))
    assert is_orbax_checkpoint(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut"]


def test_incomplete_folder_is_not_a_checkpoint(converted, tmp_path):
    """Without k3jax.json (written last) a folder is never taken for a checkpoint."""
    copy = tmp_path / "copy"
    shutil.copytree(converted["hf_bf16"], copy)
    os.remove(copy / METADATA)
    assert not is_orbax_checkpoint(copy)
    with pytest.raises(ValueError, match="k3jax orbax checkpoint folder"):
        restore_orbax(copy)


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_model_config_json_round_trips(name):
    """k3jax.json stores the model config in the training checkpoints' JSON form (to_dict / from_dict)."""
    cfg = C.PRESETS[name]()
    data = json.loads(json.dumps(to_dict(cfg)))
    assert from_dict(C.ModelConfig, data) == cfg and to_dict(from_dict(C.ModelConfig, data)) == data
