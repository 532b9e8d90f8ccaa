"""Serve a checkpoint over HTTP: ``python -m k3jax.serve --checkpoint PATH [--port 8000] [--set KEY=VALUE …]``.

OpenAI-compatible ``POST /v1/completions`` and ``/v1/chat/completions`` (``"stream": true`` for
server-sent events), ``GET /v1/models`` and ``GET /health`` (engine metrics: prefix hit rate,
evictions, pages in use). ``PATH`` is anything ``k3jax.generate`` accepts (a Hugging Face folder,
a training run, a checkpoints folder, a converted folder). Text goes through the K3 tokenizer
when ``--tokenizer DIR`` is given (or the HF folder holds ``tiktoken.model``), else bytes.
``--set`` sets the engine's sizes (``k3jax.serve.config.EngineConfig``): ``--set num_slots=64
--set max_context=32768 --set cache_bytes=40e9``. ``--draft FILE`` (a draft written by
``k3jax.infer.draft.save_draft``) turns on speculative decoding with ``draft_tokens`` (default 4)
drafted tokens per slot and step. Every program is compiled before the server
listens; the line ``serving MODEL on URL`` says it is ready.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from k3jax import cli

DEFAULT_DRAFT_TOKENS = 4  # with --draft and no --set draft_tokens=K
PARSER = cli.make_parser("python -m k3jax.serve", __doc__)
PARSER.add_argument("--checkpoint", required=True,
                    help="a Hugging Face folder, a training run folder, a checkpoints folder or a converted folder")
PARSER.add_argument("--tokenizer", default=None, help="K3 tokenizer folder (default: the byte tokenizer)")
PARSER.add_argument("--host", default="127.0.0.1", help="address to listen on")
PARSER.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
PARSER.add_argument("--model-name", default=None, help="the model id clients send (default: the folder's name)")
PARSER.add_argument("--draft", default=None,
                    help="speculative decoding with this draft (.npz from k3jax.infer.draft.save_draft)")
PARSER.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field, typed (e.g. num_slots=16)")


def _serve(args) -> int:
    from k3jax.overrides import apply_overrides
    from k3jax.serve.config import EngineConfig

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port={args.port} must lie in [0, 65536)")
    ecfg = apply_overrides(EngineConfig(), args.assignments)
    from k3jax.checkpoint_source import load_with_tokenizer
    from k3jax.compile_cache import enable_compilation_cache
    from k3jax.serve.engine import Engine
    from k3jax.serve.server import Server

    enable_compilation_cache()
    cfg, variables, tokenizer = load_with_tokenizer(args.checkpoint, args.tokenizer)
    explicit = {a.partition("=")[0].strip() for a in args.assignments}
    if ecfg.max_context > cfg.max_position and "max_context" not in explicit:  # a set value is checked
        ecfg = dataclasses.replace(ecfg, max_context=cfg.max_position)
    draft = None
    if args.draft is not None:
        from k3jax.infer.draft import load_draft

        draft = load_draft(args.draft, cfg)
        if "draft_tokens" not in explicit:
            ecfg = dataclasses.replace(ecfg, draft_tokens=DEFAULT_DRAFT_TOKENS)
    engine = Engine(variables, cfg, ecfg, decode=tokenizer.decode, draft=draft)
    engine.warm_up()
    name = args.model_name or Path(args.checkpoint).resolve().name
    server = Server(engine, tokenizer, name, args.host, args.port).start()
    print(f"serving {name} on {server.url}", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = PARSER.parse_args(argv)
    return cli.run(lambda: _serve(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
