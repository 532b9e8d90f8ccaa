"""Command line generation: ``python -m k3jax.generate --checkpoint PATH --prompt TEXT [...]``.

``PATH`` is a Hugging Face folder (``config.json`` + safetensors), a converted orbax folder
(``python -m k3jax.convert hf-to-orbax``, either layout), a training run folder (as ``k3jax.train``
writes it, with ``checkpoints/``) or a checkpoints folder; orbax runs give their newest good step
(`k3jax.checkpoint_source`). A multimodal K3 generates text with its language model; ``--image
FILE`` puts an image before the one prompt (its tower runs at prefill). Text goes through the K3 tokenizer when
``--tokenizer DIR`` is given (or the HF folder holds ``tiktoken.model``), else through the byte
tokenizer. One prompt is echoed and continued token by token as it is generated; several run as
one batch and print one ``'prompt' -> 'continuation'`` line each when done. Control characters
are shown escaped (``\\x02``), never sent raw to the terminal.
"""

from __future__ import annotations

import sys

from k3jax import cli


def escape(text: str) -> str:
    """``text`` with control characters (other than newline and tab) written as ``\\xNN`` / ``\\uNNNN``."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in "\n\t" or not (code < 32 or 127 <= code < 160):
            out.append(ch)
        else:
            out.append(f"\\x{code:02x}")
    return "".join(out)


class TextStream:
    """Prints the text of a growing token sequence as it grows: each call decodes the whole
    continuation and prints what is new, holding back a trailing U+FFFD (a UTF-8 character whose
    remaining bytes are still to come)."""

    def __init__(self, tokenizer, prompt: str, out=sys.stdout):
        self.tok, self.prompt, self.out = tokenizer, prompt, out
        self.ids: list[int] = []
        self.shown = 0
        self.started = False

    def add(self, token: int) -> None:
        if not self.started:  # the prompt is echoed only once generation has really begun
            self.out.write(escape(self.prompt))
            self.started = True
        if token != self.tok.eos_id:
            self.ids.append(int(token))
        self._show(final=False)

    def _show(self, final: bool) -> None:
        text = self.tok.decode(self.ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        if end > self.shown:
            self.out.write(escape(text[self.shown:end]))
            self.shown = end
        self.out.flush()

    def close(self) -> None:
        if self.started:
            self._show(final=True)
            self.out.write("\n")
            self.out.flush()


PARSER = cli.make_parser("python -m k3jax.generate", __doc__)
PARSER.add_argument("--checkpoint", required=True,
                    help="a Hugging Face folder, a training run folder or a checkpoints folder")
PARSER.add_argument("--prompt", action="append", required=True, help="text to continue; repeat for a batch")
PARSER.add_argument("--tokenizer", default=None, help="K3 tokenizer folder (default: the byte tokenizer)")
PARSER.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (>= 1)")
PARSER.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
PARSER.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
PARSER.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
PARSER.add_argument("--seed", type=int, default=0, help="sampling seed")
PARSER.add_argument("--image", default=None,
                    help="an image file shown before the prompt (one --prompt; a checkpoint with a vision tower)")


def _generate(args) -> int:
    from k3jax.infer.decode import check_sampling

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    check_sampling(args.temperature, args.top_k, args.top_p)
    from k3jax.checkpoint_source import load_with_tokenizer, tokenizer_for
    from k3jax.compile_cache import enable_compilation_cache
    from k3jax.infer.generate import generate

    enable_compilation_cache()
    embeddings = None
    if args.image is None:
        cfg, variables, tokenizer = load_with_tokenizer(args.checkpoint, args.tokenizer)
        prompts = [list(tokenizer.encode(p)) for p in args.prompt]
    else:
        tokenizer = tokenizer_for(args.checkpoint, args.tokenizer)
        cfg, variables, prompts, embeddings = _with_image(args, tokenizer)
    single = len(prompts) == 1
    text = TextStream(tokenizer, args.prompt[0])

    def stream(step, tokens, alive):
        if alive[0]:
            text.add(int(tokens[0]))

    out = generate(variables, cfg, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, stop_tokens=[tokenizer.eos_id], seed=args.seed,
                   stream=stream if single else None, embeddings=embeddings)
    if single:
        text.close()
        return 0
    for p, o in zip(args.prompt, out):  # one line per row: repr escapes newlines and control characters
        print(f"{p!r} -> {tokenizer.decode([t for t in o if t != tokenizer.eos_id])!r}")
    return 0


def _with_image(args, tokenizer):
    """``(text cfg, text variables, [prompt ids], embeddings [1, T, D])`` for ``--image``: the image's
    placeholder expanded to its merged tokens, then the prompt text; the tower runs once, here, and
    its features replace the placeholders' embeddings at prefill (``k3jax.vision``)."""
    from pathlib import Path

    import jax

    from k3jax.checkpoint_source import check_vocab, load_variables
    from k3jax.vision import MultimodalTransformer, text_variables
    from k3jax.vision.prompt import prepare

    if len(args.prompt) != 1:
        raise ValueError(f"--image goes with one --prompt, got {len(args.prompt)}")
    if not Path(args.image).is_file():
        raise ValueError(f"--image {args.image!r} does not exist")
    cfg, variables = load_variables(args.checkpoint, multimodal=True)
    if not hasattr(cfg, "vision"):
        raise ValueError(f"--image needs a checkpoint with a vision tower; {args.checkpoint!r} holds a text model")
    check_vocab(tokenizer, cfg.text)
    tokens, lengths, media = prepare([[Path(args.image), args.prompt[0]]], cfg, tokenizer, bos=False)
    embed = jax.jit(lambda v, t, m: MultimodalTransformer(cfg).apply(v, t, m, method=MultimodalTransformer.embed))
    return cfg.text, text_variables(variables), [tokens[0, :lengths[0]].tolist()], embed(variables, tokens, media)


def main(argv: list[str] | None = None) -> int:
    args = PARSER.parse_args(argv)
    return cli.run(lambda: _generate(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
