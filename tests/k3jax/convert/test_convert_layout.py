"""``hf-to-orbax --layout per-layer|scanned`` on the real tiny K3 (layers 1-8 scan as 2 units of 4,
``stack_1``): both stored layouts restore bit for bit into both model layouts, inspect reports the
layout, orbax -> HF is byte-identical from a scanned store, train/generate's loader takes both, and bad
combinations are refused before anything is written, a store of the earlier one-run layout
(``stack/offset_{j}``) by name. (8 fake devices: test_convert_sharded.py.)"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.checkpoint_source import abstract_variables, load_variables
from k3jax.convert import load_hf, save_hf
from k3jax.convert.__main__ import main
from k3jax.convert.inspect import format_report, inspect
from k3jax.convert.orbax_ckpt import METADATA, read_metadata, restore_orbax, restore_row
from k3jax.convert.orbax_layout import LAYOUTS, check_layout, in_layout
from k3jax.convert.safetensors_io import SafetensorsReader
from k3jax.layout import unrolled
from k3jax.params import count_params

SRC = "/work/shared/oracle/tiny_a/hf_mxfp4"


def _bits(tree) -> dict:
    return {jax.tree_util.keystr(p): (np.asarray(x).dtype, np.asarray(x).tobytes())
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The oracle converted once per layout through the CLI."""
    out = {}
    for layout in LAYOUTS:
        dst = tmp_path_factory.mktemp("orbax") / layout
        assert main(["hf-to-orbax", SRC, str(dst), "--layout", layout, "--group-mb", "0.25", "--no-progress"]) == 0
        out[layout] = dst
    return out


@pytest.fixture(scope="module")
def loaded():
    return load_hf(SRC, param_dtype=jnp.bfloat16)


@pytest.mark.parametrize("stored_layout", LAYOUTS)
def test_both_layouts_restore_bitwise_into_both_model_layouts(stored, loaded, stored_layout):
    cfg, want = loaded
    assert read_metadata(stored[stored_layout])["layout"] == stored_layout
    for layout in LAYOUTS:
        got_cfg, got = restore_orbax(stored[stored_layout], layout=layout)
        assert got_cfg == cfg
        assert ("stack_1" in got["params"]) == (layout == "scanned")
        assert _bits(got) == _bits(in_layout(want, cfg, layout)), (stored_layout, layout)
    _, default = restore_orbax(stored[stored_layout])  # the config's own layout: it scans
    assert _bits(default) == _bits(want)


def test_scanned_store_holds_stacked_leaves_one_chunk_per_layer(stored, loaded):
    cfg, want = loaded
    w1 = ("params", "stack_1", "offset_1", "moe", "w1")
    stacked = np.asarray(want["params"]["stack_1"]["offset_1"]["moe"]["w1"])
    assert stacked.shape[0] == 2  # layers 2 and 6
    for row in range(2):
        assert restore_row(stored["scanned"], w1, row).tobytes() == stacked[row].tobytes()


def test_inspect_reports_the_layout_and_the_same_counts(stored, loaded):
    cfg, _ = loaded
    reports = {layout: inspect(str(stored[layout])) for layout in LAYOUTS}
    text = format_report(reports["scanned"])
    assert "layout: scanned (layers 1-8 stacked as 2 units of 4, stack_1/offset_0..3; 6 of 10 layers traced)" in text
    assert "layout: per-layer" in format_report(reports["per-layer"])
    count = count_params(cfg)
    for r in reports.values():
        assert (r.total, r.active) == (count.total, count.active) and not r.problems
    assert reports["scanned"].params == reports["per-layer"].params
    assert reports["scanned"].nbytes == reports["per-layer"].nbytes


def test_scanned_orbax_to_hf_byte_identical(stored, tmp_path):
    back = tmp_path / "hf"
    assert main(["orbax-to-hf", str(stored["scanned"]), str(back), "--no-progress"]) == 0
    a, b = SafetensorsReader(SRC), SafetensorsReader(str(back))
    assert a.keys() == b.keys()
    for key in a.keys():
        assert a.get(key).dtype == b.get(key).dtype and a.get(key).tobytes() == b.get(key).tobytes(), key


def test_loader_of_train_and_generate_takes_both_layouts(stored, loaded):
    """``train --init-from`` / ``generate --checkpoint``'s loader restores either store into a model
    of the other layout (a scanned store into an unrolled model, and the reverse)."""
    cfg, want = loaded
    for layout, model in (("scanned", unrolled(cfg)), ("per-layer", cfg)):
        _, got = load_variables(stored[layout], abstract=lambda c, m=model: abstract_variables(m))
        assert _bits(got) == _bits(in_layout(want, cfg, "scanned" if model.scan_layers else "per-layer")), layout


def test_bad_layouts_are_refused(stored, loaded, tmp_path, capsys):
    cfg, variables = loaded
    with pytest.raises(ValueError, match=r"layout='diagonal' must be one of \('per-layer', 'scanned'\)"):
        restore_orbax(stored["scanned"], layout="diagonal")
    shallow = dataclasses.replace(cfg, num_layers=2)  # a dense and a MoE layer: nothing repeats
    with pytest.raises(ValueError, match="layout='scanned' needs a model with a repeating run of layers"):
        check_layout("scanned", shallow)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_variables(unrolled(shallow)))
    save_hf(unrolled(shallow), zeros, str(tmp_path / "shallow"))
    dst = tmp_path / "dst"
    assert main(["hf-to-orbax", str(tmp_path / "shallow"), str(dst), "--layout", "scanned", "--no-progress"]) == 2
    assert "needs a model with a repeating run of layers" in capsys.readouterr().err
    assert not dst.exists() and not (tmp_path / "dst.incomplete").exists()
    lying = tmp_path / "lying"  # scanned leaves, metadata claiming per-layer
    shutil.copytree(stored["scanned"], lying)
    meta = json.loads((lying / METADATA).read_text())
    (lying / METADATA).write_text(json.dumps({**meta, "layout": "per-layer"}))
    with pytest.raises(ValueError, match="leaves missing .* for the model config and layout 'per-layer'"):
        restore_orbax(lying)
    (lying / METADATA).write_text(json.dumps({**meta, "layout": "diagonal"}))
    with pytest.raises(ValueError, match="layout='diagonal', this k3jax reads one of"):
        restore_orbax(lying)


def test_a_store_of_the_one_run_layout_is_refused_by_name(stored, loaded, tmp_path):
    """A scanned store written before several runs (one ``stack`` entry): restore and inspect name the
    layout and the runs this k3jax expects instead of a missing-leaf list."""
    import orbax.checkpoint as ocp

    cfg, want = loaded
    scanned = in_layout(want, cfg, "scanned")
    old = {name: {("stack" if k == "stack_1" else k): v for k, v in tree.items()} for name, tree in scanned.items()}
    folder = tmp_path / "old"
    ocp.PyTreeCheckpointer().save(folder / "state", jax.tree.map(np.asarray, old))
    shutil.copy(stored["scanned"] / METADATA, folder / METADATA)
    message = r"holds 'stack'/offset_\{j\}: the one-run scanned layout of earlier k3jax.*\(this model: stack_1\)"
    for layout in LAYOUTS:
        with pytest.raises(ValueError, match=message):
            restore_orbax(folder, layout=layout)
    assert any("one-run scanned layout" in p for p in inspect(str(folder)).problems)
