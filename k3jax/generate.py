"""Command line generation: ``python -m k3jax.generate --checkpoint PATH --prompt TEXT [...]``.

``PATH`` is a Hugging Face folder (``config.json`` + safetensors; ``k3jax.convert.load_hf``) or an
orbax run directory written by ``k3jax.train`` (the newest good step; the model config is read
from the checkpoint's metadata). Text goes through the K3 tokenizer when ``--tokenizer DIR`` is
given (or the HF folder holds ``tiktoken.model``), else through the byte tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3jax import config as config_lib
from k3jax.data.tokenizer import load_tokenizer
from k3jax.infer.generate import generate
from k3jax.train.config import from_dict


def load_orbax(path: str):
    """``(cfg, variables)`` from the newest step of an orbax run directory."""
    import orbax.checkpoint as ocp

    from k3jax.train.checkpoint import CheckpointConfig, Checkpointer

    ckpt = Checkpointer(CheckpointConfig(dir=path))
    steps = ckpt.all_steps()
    if not steps:
        raise ValueError(f"checkpoint={path!r} holds no orbax steps")
    meta = ckpt._read_meta(steps[-1])
    model = (meta.get("config") or {}).get("model")
    if model is None:
        raise ValueError(f"checkpoint={path!r} has no model config in its metadata")
    cfg = from_dict(config_lib.ModelConfig, model)
    state = ocp.StandardCheckpointer().restore(Path(path).absolute() / str(steps[-1]) / "state")
    return cfg, {"params": state["params"]["model"], "balance": state["balance"]["model"]}


def load(path: str):
    if (Path(path) / "config.json").exists():
        from k3jax.convert import load_hf

        return load_hf(path)
    if Path(path).is_dir():
        return load_orbax(path)
    raise ValueError(f"checkpoint={path!r} must be a Hugging Face folder (config.json) or an orbax run directory")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m k3jax.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--tokenizer", default=None, help="K3 tokenizer folder (default: the byte tokenizer)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from k3jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()
    cfg, variables = load(args.checkpoint)
    tok_dir = args.tokenizer
    if tok_dir is None and (Path(args.checkpoint) / "tiktoken.model").exists():
        tok_dir = args.checkpoint
    tokenizer = load_tokenizer(tok_dir)
    prompts = [list(tokenizer.encode(p)) for p in args.prompt]
    single = len(prompts) == 1

    def stream(step, tokens, alive):
        if single and alive[0]:
            sys.stdout.write(tokenizer.decode([int(tokens[0])]))
            sys.stdout.flush()

    out = generate(variables, cfg, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, stop_tokens=[tokenizer.eos_id], seed=args.seed,
                   stream=stream)
    if single:
        print()
    else:
        for p, o in zip(args.prompt, out):
            print(f"{p!r} -> {tokenizer.decode(o)!r}")


if __name__ == "__main__":
    main()
