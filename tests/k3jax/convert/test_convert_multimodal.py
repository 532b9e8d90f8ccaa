"""The conversion CLI carries a multimodal K3's vision tower and projector: an HF folder written by
``k3jax.vision.checkpoint.save_hf`` (tiny text model + tiny tower, bf16) -> orbax -> HF is
byte-identical per tensor with the same vision config; the orbax tree is ``MultimodalTransformer``'s
and restores bit for bit; ``inspect`` counts the encoder; train/generate's loader gives the language
model (or the whole model when asked)."""

import dataclasses
import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.checkpoint_source import load_variables
from k3jax.convert.__main__ import main
from k3jax.convert.inspect import format_report, inspect
from k3jax.convert.orbax_ckpt import read_metadata, restore_orbax
from k3jax.convert.safetensors_io import SafetensorsReader
from k3jax.vision import MultimodalTransformer, checkpoint, text_variables
from k3jax.vision.params import _probe, count_params, vision_table
from tests.k3jax.vision.conftest import make_cfg


def _bits(tree) -> dict:
    return {jax.tree_util.keystr(p): (np.asarray(x).dtype, np.asarray(x).tobytes())
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A random multimodal model saved as an HF folder (bf16), then converted with the CLI."""
    cfg = make_cfg()
    shapes = jax.eval_shape(MultimodalTransformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
                            _probe(cfg.vision))
    leaves, treedef = jax.tree_util.tree_flatten(nn.meta.unbox(shapes))
    rng = np.random.default_rng(0)
    variables = jax.tree_util.tree_unflatten(treedef, [rng.standard_normal(x.shape).astype(x.dtype) for x in leaves])
    root = tmp_path_factory.mktemp("mm")
    checkpoint.save_hf(cfg, variables, str(root / "hf"), dtype=jnp.bfloat16)
    assert main(["hf-to-orbax", str(root / "hf"), str(root / "orbax"), "--group-mb", "0.1", "--no-progress"]) == 0
    return cfg, root


def test_hf_orbax_hf_is_byte_identical_with_the_tower(folders):
    _, root = folders
    assert main(["orbax-to-hf", str(root / "orbax"), str(root / "back"), "--no-progress"]) == 0
    a, b = SafetensorsReader(str(root / "hf")), SafetensorsReader(str(root / "back"))
    assert a.keys() == b.keys() and any(k.startswith("vision_tower.") for k in a.keys())
    for key in a.keys():
        assert a.get(key).dtype == b.get(key).dtype and a.get(key).tobytes() == b.get(key).tobytes(), key
    config = lambda d: json.loads((root / d / "config.json").read_text())  # noqa: E731
    assert config("back")["vision_config"] == config("hf")["vision_config"]
    assert config("back")["media_placeholder_token_id"] == config("hf")["media_placeholder_token_id"]
    pre = lambda d: json.loads((root / d / checkpoint.PREPROCESSOR).read_text())  # noqa: E731
    assert pre("back") == pre("hf")


def test_restore_is_the_multimodal_tree_bitwise(folders):
    cfg, root = folders
    got_cfg, got = restore_orbax(root / "orbax")
    want_cfg, want = checkpoint.load_hf(str(root / "hf"), param_dtype=jnp.bfloat16)
    assert got_cfg == want_cfg and got_cfg.vision.hidden == cfg.vision.hidden
    assert sorted(got["params"]) == ["language_model", "mm_projector", "vision_tower"]
    assert _bits(got) == _bits(want)
    assert read_metadata(root / "orbax")["vision"]["media_token_id"] == cfg.media_token_id


def test_inspect_counts_the_encoder(folders):
    cfg, root = folders
    want = count_params(cfg)
    parts = vision_table(cfg.vision, cfg.text.hidden)
    for path in (root / "hf", root / "orbax"):
        report = inspect(str(path))
        assert not report.problems, report.problems
        assert (report.total, report.active) == (want.total, want.active)
        assert report.vision == parts
        assert "vision tower" in format_report(report) and "vision projector" in format_report(report)


def test_loader_gives_the_language_model_or_the_whole_model(folders):
    """``generate --checkpoint`` / ``train --init-from`` on a converted multimodal checkpoint."""
    cfg, root = folders
    text_cfg, text = load_variables(root / "orbax")
    full_cfg, full = load_variables(root / "orbax", multimodal=True)
    assert text_cfg == full_cfg.text and _bits(text) == _bits(text_variables(full))
    hf_cfg, hf = load_variables(root / "hf", multimodal=True)
    assert hf_cfg.vision == dataclasses.replace(full_cfg.vision, param_dtype=hf_cfg.vision.param_dtype)
    assert sorted(hf["params"]) == sorted(full["params"])  # load_hf's default parameter dtype: float32


def test_tower_that_disagrees_with_its_config_is_refused_before_writing(folders, tmp_path, capsys):
    _, root = folders
    bad = tmp_path / "bad"
    shutil.copytree(root / "hf", bad)
    config = json.loads((bad / "config.json").read_text())
    config["vision_config"]["vt_intermediate_size"] += 8
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["hf-to-orbax", str(bad), str(tmp_path / "dst"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tensor 'vision_tower.encoder.blocks.0.mlp.fc0.weight' has shape" in err
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.incomplete").exists()
