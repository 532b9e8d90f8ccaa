"""generate(): greedy equals argmax of the forward, ragged rows, stop tokens, streaming, bad input,
cache sizes against SPEC §2/§3."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.infer.cache import KDACache, MLACache, bytes_per_token, init_cache, tree_bytes
from k3jax.infer.decode import warp
from k3jax.infer.generate import generate
from k3jax.model import Transformer


def _greedy_reference(cfg, variables, prompt, n):
    seq = list(prompt)
    fwd = jax.jit(Transformer(cfg).apply)
    for _ in range(n):
        with jax.default_matmul_precision("highest"):
            logits = fwd(variables, jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_ragged_matches_forward_and_streams(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    seen = []
    with jax.default_matmul_precision("highest"):
        out = generate(variables, cfg, prompts, max_new_tokens=4, temperature=0.0, seed=0,
                       stream=lambda i, tok, alive: seen.append((i, tok.tolist(), alive.tolist())))
    for p, o in zip(prompts, out):
        assert o == _greedy_reference(cfg, variables, p, 4)
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    assert [s[1] for s in seen] == [[a, b] for a, b in zip(*out)]


def test_stop_tokens_and_sampling_is_seeded(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    a = generate(variables, cfg, prompts, max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    b = generate(variables, cfg, prompts, max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    assert a == b and all(len(r) == 6 for r in a)
    stop = a[0][2]
    c = generate(variables, cfg, prompts, max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, seed=3,
                 stop_tokens=[stop])
    assert c[0] == a[0][:a[0].index(stop) + 1]  # ends at (and keeps) the first stop token
    assert c[1] == (a[1][:a[1].index(stop) + 1] if stop in a[1] else a[1])


def test_warp_top_k_top_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    p = np.exp(np.asarray(warp(logits, 1.0, 2, 1.0)))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]], rtol=1e-6)
    p = np.exp(np.asarray(warp(logits, 1.0, None, 0.8)))  # 0.5 + 0.3 reaches 0.8: two tokens
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]], rtol=1e-6)
    p = np.exp(np.asarray(warp(logits, 1.0, None, 0.81)))
    np.testing.assert_allclose(p, [[0.5, 0.3, 0.15, 0]] / np.float32(0.95), rtol=1e-6)
    np.testing.assert_array_equal(np.exp(np.asarray(warp(logits, 0.0, None, 1.0))), [[1, 0, 0, 0]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1] * 10], max_len=12), "cache length"),
    (dict(prompts=[[]]), r"prompts\[0\]"),
    (dict(prompts=[]), "prompts"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(prompts=[[1, 256]]), r"vocab_size=256"),
    (dict(prompts=[[-1]]), r"vocab_size=256"),
    (dict(stop_tokens=[300]), "stop_tokens"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_input_raises_before_compiling(tiny_model, kwargs, match, monkeypatch):
    gen = importlib.import_module("k3jax.infer.generate")  # the module (the package exports the function)
    monkeypatch.setattr(gen, "_run", lambda *a, **k: pytest.fail("compiled despite bad input"))
    args = dict(prompts=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(tiny_model.variables, tiny_model.cfg, **args)


def test_cache_bytes_match_spec():
    """SPEC §3: 576 values per token per MLA layer for K3; §2: S [H,K,V] fp32 + 3 conv tails of W-1."""
    k3 = config.kimi_k3()
    per = bytes_per_token(k3)
    assert per["mla"] == (512 + 64) * 2  # bf16
    assert per["kda_per_sequence"] == (96 * 128 * 128 + 3 * 3 * 96 * 128) * 4
    cfg = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    B, S = 3, 40
    cache = jax.eval_shape(lambda: init_cache(cfg, B, S))
    # The scanned run's caches are one entry per unit offset, stacked over its repeats.
    layers = jax.tree.leaves(cache.layers, is_leaf=lambda c: isinstance(c, (KDACache, MLACache)))
    count = 0
    for layer in layers:
        n = layer.lengths.shape[0] if isinstance(layer, MLACache) and layer.lengths.ndim == 2 else (
            layer.state.shape[0] if isinstance(layer, KDACache) and layer.state.ndim == 5 else 1)
        count += n
        if isinstance(layer, MLACache):
            assert tree_bytes(layer.latent) == n * B * S * bytes_per_token(cfg)["mla"]
        else:
            assert isinstance(layer, KDACache)
            assert tree_bytes(layer) == n * B * bytes_per_token(cfg)["kda_per_sequence"]
    assert count == cfg.num_layers


def test_cli_loads_an_orbax_run(tiny_model, tmp_path):
    """The CLI's orbax path: the model config comes back from the checkpoint metadata, the
    variables from the train state's "model" entries (a run folder or its checkpoints folder)."""
    from k3jax.checkpoint_source import load_variables
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.config import CheckpointConfig, TrainConfig

    cfg, v = tiny_model.cfg, tiny_model.variables
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "checkpoints"), async_save=False), TrainConfig(model=cfg))
    ckpt.save(3, {"params": {"model": v["params"]}, "balance": {"model": v["balance"]}}, None)
    ckpt.close()
    for path in (tmp_path, tmp_path / "checkpoints"):
        got_cfg, got = load_variables(path)
        assert got_cfg == cfg
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), got, v))


def test_decoding_runs_on_per_layer_weights(tiny_model, monkeypatch):
    """generate (and the serving engine) decode with every layer's own weights: the scanned stack's
    per-repetition slices are copied before each matmul on the GPU (benchmarks/RESULTS.md, stop 31)."""
    import chex

    from k3jax.infer.decode import decode_layout
    from k3jax.layout import is_scanned, scan_plan, to_per_layer

    cfg, variables = tiny_model.cfg, tiny_model.variables
    assert scan_plan(cfg) is not None and is_scanned(variables["params"])
    per_layer, dcfg = decode_layout(variables, cfg)
    assert not dcfg.scan_layers and dataclasses.replace(dcfg, scan_layers=True) == cfg
    assert not any(map(is_scanned, per_layer.values()))
    # the decode collection's kernels (test_decode.py) moved alike from the scanned and the per-layer tree
    chex.assert_trees_all_equal(per_layer, decode_layout(to_per_layer(variables, cfg), dcfg)[0])
    assert decode_layout(per_layer, dcfg) == (per_layer, dcfg)  # already per layer: unchanged
    seen = []
    gen = importlib.import_module("k3jax.infer.generate")
    run = gen._run
    monkeypatch.setattr(gen, "_run", lambda v, *a, cfg, **k: seen.append((v, cfg)) or run(v, *a, cfg=cfg, **k))
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    with jax.default_matmul_precision("highest"):
        out = generate(variables, cfg, prompts, max_new_tokens=3, temperature=0.0)
        again = generate(per_layer, dcfg, prompts, max_new_tokens=3, temperature=0.0)
    assert out == again
    assert [c.scan_layers for _, c in seen] == [False, False]
    assert not is_scanned(seen[0][0]["params"])


@pytest.mark.gpu
def test_device_loop_streams_and_stops_on_gpu(tiny_model):
    """On a GPU ``DECODE_XLA_OPTIONS`` puts the decode loop, whose end depends on the tokens, in one CUDA
    graph with conditional nodes (WHILE / CONDITIONAL command buffers). Greedy tokens still equal the
    forward's, a stream (a host callback inside the loop) still sees every step, and a stop token still
    ends its row early."""
    assert jax.default_backend() == "gpu"
    test_greedy_ragged_matches_forward_and_streams(tiny_model)
    cfg, variables = tiny_model.cfg, tiny_model.variables
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    with jax.default_matmul_precision("highest"):
        full = generate(variables, cfg, prompts, max_new_tokens=6, temperature=0.0)
        stop = full[0][2]
        cut = generate(variables, cfg, prompts, max_new_tokens=6, temperature=0.0, stop_tokens=[stop])
    assert full == [_greedy_reference(cfg, variables, p, 6) for p in prompts]
    assert cut[0] == full[0][:full[0].index(stop) + 1]
    assert cut[1] == (full[1][:full[1].index(stop) + 1] if stop in full[1] else full[1])
