"""Model weights from wherever a user has them: ``load_variables(path) -> (cfg, variables)``.

``path`` may be

1. a Hugging Face folder (``config.json`` + safetensors; `k3jax.convert.load_hf`),
2. a training run folder (``<run>/checkpoints/<step>/…``, as ``k3jax.train`` writes it), or
3. a checkpoints folder (``<step>/…`` orbax steps), or
4. a converted checkpoint (``python -m k3jax.convert hf-to-orbax``; `k3jax.convert.orbax_ckpt`).

Orbax steps are read through `k3jax.train.checkpoint.Checkpointer.restore`: the newest step that
checks out whole (a corrupt one is moved aside with one warning line), only the model's
parameters and balancing biases (``partial``), placed as ``abstract`` says (shardings for a
mesh). The model config comes from the checkpoint itself (the step's metadata or ``config.json``).
`describe_source` names the kind; a new kind of source is one more branch there and in
`load_variables`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.vision.config import MultimodalConfig
from k3jax.train.config import from_dict

HF, ORBAX, CONVERTED = "hf", "orbax", "converted"
# cfg -> abstract {"params", "balance"} tree (ShapeDtypeStruct leaves, with shardings for a mesh)
AbstractFn = Callable[[ModelConfig], dict]


def describe_source(path: str | Path) -> tuple[str, Path]:
    """``(kind, folder)``: ``("hf", path)``, ``("converted", path)`` or ``("orbax", the checkpoints
    folder)``; ``ValueError`` naming the path and the accepted layouts otherwise."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is a file; expected a Hugging Face folder (config.json), "
                         "a training run folder (with checkpoints/) or a checkpoints folder (with step folders)")
    if (path / "config.json").is_file():
        return HF, path
    from k3jax.convert.orbax_ckpt import is_orbax_checkpoint

    if is_orbax_checkpoint(path):
        return CONVERTED, path
    for folder in (path / "checkpoints", path):
        if folder.is_dir() and any(p.is_dir() and p.name.isdigit() for p in folder.iterdir()):
            return ORBAX, folder
    raise ValueError(f"checkpoint {str(path)!r} holds no config.json, no k3jax.json, no checkpoints/ folder and no step "
                     "folders; expected a Hugging Face folder, a converted orbax folder, a training run folder or a checkpoints folder")


def load_variables(path: str | Path, *, abstract: AbstractFn | None = None,
                   multimodal: bool = False) -> tuple[ModelConfig | MultimodalConfig, dict]:
    """``(cfg, {"params", "balance"})`` of the model at ``path`` (any layout of `describe_source`).

    A multimodal checkpoint (a K3 HF folder or converted checkpoint with a vision tower) gives its
    language model, or with ``multimodal=True`` its ``MultimodalConfig`` and ``MultimodalTransformer``
    variables (``abstract`` then does not apply)."""
    kind, folder = describe_source(path)
    if kind == ORBAX:
        return _load_orbax(folder, abstract or abstract_variables)
    cfg, variables = _load_converted(folder) if kind == CONVERTED else _load_hf(folder, multimodal)
    if multimodal:
        return cfg, variables
    if hasattr(cfg, "text"):  # the language model of a multimodal checkpoint
        from k3jax.vision.model import text_variables

        cfg, variables = cfg.text, text_variables(variables)
    if abstract is not None:
        from k3jax.convert.orbax_layout import in_layout

        want = abstract(cfg)
        variables = in_layout(variables, cfg, _layout_of(want))
        _check_layout(variables, want, folder)
        variables = jax.tree.map(lambda x, a: jax.device_put(x.astype(a.dtype), a.sharding), variables, want)
    return cfg, variables


def _load_hf(folder: Path, multimodal: bool):
    """A multimodal folder (a ``vision_config`` and tower tensors) whole when asked, else the text model."""
    from k3jax.convert import load_hf

    if multimodal and "vision_config" in json.loads((folder / "config.json").read_text()):
        from k3jax.convert.safetensors_io import SafetensorsReader
        from k3jax.vision.checkpoint import load_hf as load_multimodal
        from k3jax.vision.hf_keys import VISION_PREFIXES

        if any(k.startswith(VISION_PREFIXES) for k in SafetensorsReader(str(folder)).keys()):
            return load_multimodal(str(folder))
    return load_hf(str(folder))


def _load_converted(folder: Path):
    """Either stored layout, restored in the config's own (the loader converts it if asked for another)."""
    from k3jax.convert.orbax_ckpt import restore_orbax

    return restore_orbax(folder)


def tokenizer_for(path: str | Path, tokenizer_dir: str | None = None):
    """The K3 tokenizer from ``tokenizer_dir``, else from the HF folder's own ``tiktoken.model``,
    else bytes; read before any weights."""
    from k3jax.data.tokenizer import load_tokenizer

    kind, folder = describe_source(path)
    if tokenizer_dir is None and kind == HF and (folder / "tiktoken.model").exists():
        tokenizer_dir = str(folder)
    return load_tokenizer(tokenizer_dir)


def check_vocab(tokenizer, cfg: ModelConfig) -> None:
    """``ValueError`` when the tokenizer has more ids than the model's vocabulary."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"--tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{cfg.vocab_size}; use the tokenizer the model was trained with")


def load_with_tokenizer(path: str | Path, tokenizer_dir: str | None = None) -> tuple[ModelConfig, dict, Any]:
    """``(cfg, variables, tokenizer)`` for a text command line (``tokenizer_for``, then the weights;
    ``check_vocab``)."""
    tokenizer = tokenizer_for(path, tokenizer_dir)
    cfg, variables = load_variables(path)
    check_vocab(tokenizer, cfg)
    return cfg, variables, tokenizer


def _load_orbax(folder: Path, abstract: AbstractFn) -> tuple[ModelConfig, dict]:
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.config import CheckpointConfig

    found = {}

    def target(meta: dict) -> dict:
        model = (meta.get("config") or {}).get("model")
        if model is None:
            raise ValueError(f"checkpoint {str(folder)!r} has no model config in its metadata")
        found["cfg"] = cfg = from_dict(ModelConfig, model)
        v = abstract(cfg)
        return {"params": {"model": v["params"]}, "balance": {"model": v["balance"]}}

    ckpt = Checkpointer(CheckpointConfig(dir=str(folder)), read_only=True)
    try:
        restored = ckpt.restore(target, partial=True)
    finally:
        ckpt.close()
    if restored is None:
        raise ValueError(f"checkpoint {str(folder)!r} holds no restorable step")
    state, _, _ = restored
    return found["cfg"], {"params": state["params"]["model"], "balance": state["balance"]["model"]}


def _layout_of(variables: dict) -> str:
    """``"scanned"`` when the tree holds scanned runs' stacked entries, else ``"per-layer"``."""
    from k3jax.layout import is_scanned

    return "scanned" if is_scanned(variables["params"]) else "per-layer"


def _check_layout(variables: dict, want: dict, folder: Path) -> None:
    """``ValueError`` naming the first leaves whose shapes differ (or that only one side has)."""
    shapes = lambda tree: {jax.tree_util.keystr(p): tuple(x.shape)
                           for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    have, need = shapes(variables), shapes(want)
    if have == need:
        return
    differ = [f"{k}: {have.get(k)} vs {need.get(k)}" for k in sorted(set(have) | set(need))
              if have.get(k) != need.get(k)]
    raise ValueError(f"checkpoint {str(folder)!r} holds a model of another shape than the one asked for "
                     f"({len(differ)} leaves differ, checkpoint vs wanted: {'; '.join(differ[:3])})")


def abstract_variables(cfg: ModelConfig) -> dict:
    """The model's ``{"params", "balance"}`` as unsharded ``ShapeDtypeStruct`` leaves."""
    import flax.linen as nn

    from k3jax.model import Transformer

    tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)
    v = nn.unbox(boxed)
    return {"params": v["params"], "balance": v.get("balance", {})}

