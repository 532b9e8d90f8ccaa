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


@pytest.mark.slow  # compiles the multimodal forward, prefill and decode loop (~3 min on 2 busy cores)
def test_generate_with_an_image_continues_as_the_full_forward(folders, tmp_path, capsys):
    """``generate --checkpoint CONVERTED --image FILE``: the tower runs at prefill, then greedy decode
    gives the tokens a full multimodal forward picks (argmax at the last position, twice)."""
    from PIL import Image

    from k3jax.data.tokenizer import load_tokenizer
    from k3jax.generate import main as generate_main
    from k3jax.infer.generate import generate
    from k3jax.vision.prompt import prepare

    cfg, root = folders
    picture = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 44, 3), np.uint8)).save(picture)
    mm_cfg, variables = load_variables(root / "orbax", multimodal=True)
    model = MultimodalTransformer(mm_cfg)
    tokens, _, media = prepare([[picture, "ab"]], mm_cfg, load_tokenizer(None), bos=False)  # as the CLI does
    x = model.apply(variables, tokens, media, method=MultimodalTransformer.embed)
    out = generate(text_variables(variables), mm_cfg.text, [tokens[0].tolist()], max_new_tokens=2, temperature=0.0,
                   embeddings=x)[0]
    forward = jax.jit(lambda t: model.apply(variables, t, media))
    first = int(np.argmax(np.asarray(forward(tokens))[0, -1]))
    second = int(np.argmax(np.asarray(forward(np.concatenate([tokens, [[first]]], axis=1)))[0, -1]))
    assert out == [first, second]
    assert generate_main(["--checkpoint", str(root / "orbax"), "--image", str(picture), "--prompt", "ab",
                          "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_generate_image_bad_input_is_one_error_line(folders, tmp_path, capsys):
    from k3jax.generate import main as generate_main

    _, root = folders
    picture = tmp_path / "picture.png"
    picture.write_bytes(b"not a png")
    cases = [(["--checkpoint", str(root / "orbax"), "--image", str(tmp_path / "none.png"), "--prompt", "a"],
              "--image '" + str(tmp_path / "none.png") + "' does not exist"),
             (["--checkpoint", str(root / "orbax"), "--image", str(picture), "--prompt", "a", "--prompt", "b"],
              "--image goes with one --prompt, got 2"),
             (["--checkpoint", "/work/shared/oracle/tiny_a/hf_bf16", "--image", str(picture), "--prompt", "a"],
              "needs a checkpoint with a vision tower"),  # a vision_config without tower tensors
             (["--checkpoint", str(root / "orbax"), "--image", str(picture), "--prompt", "a"], "image")]
    for argv, message in cases:
        assert generate_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_restore_onto_a_mesh_places_the_tower_by_its_logical_axes(folders, tmp_path):
    """The tower's shardings come from its modules' logical axis names, like the text model's."""
    from k3jax.convert.convert import hf_to_orbax
    from k3jax.convert.orbax_layout import mesh_shardings
    from sharding import make_mesh

    cfg, root = folders
    mesh = make_mesh()
    hf_to_orbax(str(root / "hf"), str(tmp_path / "orbax"), mesh=mesh)
    got_cfg, got = restore_orbax(tmp_path / "orbax", shardings=mesh, layout="per-layer")
    want = mesh_shardings(got_cfg, mesh)
    flat = {tuple(str(k.key) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}
    assert flat.keys() == want.keys() and any(p[1] == "vision_tower" for p in flat)
    assert all(x.sharding.is_equivalent_to(want[p], x.ndim) for p, x in flat.items())
    _, single = restore_orbax(root / "orbax", layout="per-layer")
    assert _bits(got) == _bits(single)
