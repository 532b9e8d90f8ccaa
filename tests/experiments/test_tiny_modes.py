"""Every experiment imports, and runs end to end in its ``--tiny`` mode (a few CPU steps).

The tiny training runs compile several train steps each (about a minute per model on a quiet
2-core CPU), so they are marked slow; importing every script and its flags is in the default run.
"""

import importlib
import json

import pytest

TRAINING = ("ablate_attn_res", "ablate_situ", "ablate_kda_gate", "ablate_latent_moe", "ablate_balance")
SCRIPTS = ("accounting", "scaling_k3_vs_k2", "ablations", "balance_qb_vs_sign") + TRAINING


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_imports_and_documents_its_command(name):
    module = importlib.import_module(f"experiments.{name}")
    doc = module.__doc__
    assert "python" in doc and ("Hypothesis" in doc or "hypothesis" in doc or name in ("ablations", "accounting"))
    assert callable(module.main)


def test_families_differ_only_in_the_listed_switches():
    from experiments import families

    k2, k3 = families.family_model("k2", 96), families.family_model("k3", 96)
    assert k2.kda is None and k3.layer_kinds.count(k3.layer_kinds[0]) == 3  # 3 KDA : 1 MLA
    assert (k2.mlp.activation, k3.mlp.activation) == ("swiglu", "situ")
    assert k2.attn_res is None and k3.attn_res is not None
    assert k2.moe.num_experts / k2.moe.top_k == 48 and k3.moe.num_experts / k3.moe.top_k == 56
    assert (k2.moe.num_shared_experts, k3.moe.num_shared_experts) == (1, 2)
    assert (k2.moe.latent_dim, k3.moe.latent_dim) == (None, 48)
    assert (k2.balance.method, k3.balance.method) == ("sign", "qb_hist")
    assert (k2.hidden, k2.num_layers, k2.moe.expert_intermediate) == (k3.hidden, k3.num_layers, k3.moe.expert_intermediate)
    base = families.k3_baseline(96)
    full = families.full_width_experts(base)
    assert full.moe.num_experts * full.moe.top_k * 2 * 2 == base.moe.num_experts * base.moe.top_k  # E and k halved
    with pytest.raises(ValueError, match="width"):
        families.family_model("k3", 50)
    with pytest.raises(ValueError, match="family"):
        families.family_model("k4", 64)


@pytest.mark.slow
def test_scaling_tiny(tmp_path):
    from experiments import scaling_k3_vs_k2 as s

    result = s.main(["--tiny", "--out", str(tmp_path)])
    assert result["analysis"]["complete"] and result["analysis"]["fit"] is not None
    assert len(list((tmp_path / "scaling_runs_tiny").glob("*.json"))) == 4
    again = s.main(["--tiny", "--out", str(tmp_path)])  # resumes: nothing left to train
    assert again["runs"].keys() == result["runs"].keys()
    assert json.loads((tmp_path / "scaling_k3_vs_k2.json").read_text())["tiny"]


@pytest.mark.slow
def test_ablations_tiny(tmp_path):
    from experiments import ablations

    results = ablations.main(["--tiny", "--out", str(tmp_path)])
    assert set(results) == set(TRAINING)
    assert len(list((tmp_path / "ablation_runs_tiny").glob("*.json"))) == 7  # the baseline trains once
    for name, result in results.items():
        assert (tmp_path / f"{name}.json").exists() and (tmp_path / f"{name}.md").exists()
        assert all(r["held_out_loss"] > 0 for r in result["runs"].values())
