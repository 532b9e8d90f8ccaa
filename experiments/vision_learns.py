"""A tiny K3-shaped multimodal model learns to see: colours and counts of shapes rendered with Pillow.

Hypothesis: trained from scratch with the next-token loss only (tower and language model
together, as K3 trains MoonViT-V2), the model answers questions about an image well above a
text-only baseline, which sees the same questions without the image and so can do no better
than the answer prior (1/4 per task).

Task (one model, two questions, balanced answers): each image shows 1-4 filled shapes (circle,
square, triangle) on a noisy grey background.
  "colour?" -> the colour of the shapes (all one colour here: r, g, b or y)
  "count?"  -> how many shapes (1-4)
Prompt bytes: BOS, one media placeholder (expanded to the image's merged tokens), the question,
then the answer byte. The loss is the next-token cross-entropy only (no auxiliary vision loss),
taken at the answer position (``--loss_on text``: at every text position, where the fixed question
bytes dilute the answer's gradient and the first CPU run stayed at chance after 200 steps).

What differs from the baseline: only the image. The baseline has the same model, data order,
seeds and steps, with the placeholder and the media removed from each prompt.

Commands
  CPU (the slow test; 400 steps a run; measured ~11 min wall for both runs on the 2-core machine shared
  with a load of ~20, most of it two ~3-minute compiles; colour 1.00 vs 0.25 text-only, count at chance):
    PYTHONPATH=. python experiments/vision_learns.py --preset cpu --out experiments/results
  H200 (one command; 84 px images = 9 image tokens, a 6-layer text model, 1500 steps of 128 a run,
  bf16; expected 3-4 min including compiles; held-out accuracy printed every 500 steps):
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 experiments/vision_learns.py --preset h200 --out $OUT/vision_learns
Writes vision_learns.{json,png,md} under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from PIL import Image, ImageDraw

from k3jax.config import tiny
from k3jax.vision import MultimodalConfig, MultimodalTransformer, build_inputs, image_media, tiny_vision

MEDIA_ID, BOS, PAD = 1, 2, 0
COLOURS = {"r": (220, 40, 40), "g": (40, 180, 60), "b": (50, 80, 220), "y": (230, 210, 40)}
QUESTIONS = {"colour": "colour?", "count": "count?"}


@dataclasses.dataclass(frozen=True)
class Settings:
    image: int = 56  # pixels a side
    train: int = 2048  # training samples
    test: int = 256
    batch: int = 32
    steps: int = 200
    lr: float = 3e-3
    text_layers: int = 2
    text_hidden: int = 64
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    dtype: str = "float32"
    seed: int = 0
    eval_every: int = 0
    loss_on: str = "answer"  # "answer": the next-token loss at the answer position; "text": at every text position


PRESETS = {
    "cpu": Settings(steps=400, lr=3e-3),
    "smoke": Settings(train=64, test=32, batch=16, steps=3),
    "h200": Settings(image=84, train=8192, test=1024, batch=128, steps=1500, lr=2e-3, text_layers=6,
                     text_hidden=128, vision_hidden=128, vision_layers=4, vision_heads=4, dtype="bfloat16",
                     eval_every=500),
}


def render(rng: np.random.Generator, size: int) -> tuple[np.ndarray, str, str]:
    """An image with 1-4 non-overlapping shapes of one colour: (pixels, colour letter, count digit)."""
    colour = rng.choice(list(COLOURS))
    count = int(rng.integers(1, 5))
    base = rng.integers(100, 160)
    img = Image.fromarray(np.clip(base + rng.normal(0, 6, (size, size, 3)), 0, 255).astype(np.uint8))
    draw, r, placed = ImageDraw.Draw(img), size // 8, []
    while len(placed) < count:
        x, y = rng.integers(r + 1, size - r - 1, 2)
        if all((x - a) ** 2 + (y - b) ** 2 > (2 * r + 2) ** 2 for a, b in placed):
            placed.append((x, y))
            box, kind = [x - r, y - r, x + r, y + r], rng.integers(3)
            fill = tuple(int(c) for c in np.clip(np.array(COLOURS[colour]) + rng.integers(-20, 21, 3), 0, 255))
            if kind == 0:
                draw.ellipse(box, fill=fill)
            elif kind == 1:
                draw.rectangle(box, fill=fill)
            else:
                draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
            if len(placed) == count:
                break
        if len(placed) < count and rng.random() < 0.01:  # crowded: start again
            placed = []
    return np.asarray(img), colour, str(count)


def make_cfg(s: Settings) -> MultimodalConfig:
    dtype = jnp.dtype(s.dtype)
    text = dataclasses.replace(tiny(), num_layers=s.text_layers, hidden=s.text_hidden, dtype=dtype, max_position=256)
    # The XLA paths everywhere: at these widths the kernels are not the subject (and need wider heads).
    text = dataclasses.replace(text, kda=dataclasses.replace(text.kda, implementation="xla"),
                               moe=dataclasses.replace(text.moe, implementation="xla"),
                               mla=dataclasses.replace(text.mla, attention_implementation="xla"))
    grid = s.image // 14
    vision = tiny_vision(hidden=s.vision_hidden, num_layers=s.vision_layers, num_heads=s.vision_heads,
                         head_dim=s.vision_hidden // s.vision_heads, mlp_dim=4 * s.vision_hidden, pos_grid=(grid, grid),
                         dtype=dtype)
    return MultimodalConfig(text=text, vision=vision, media_token_id=MEDIA_ID)


def renders(s: Settings, n: int, seed: int) -> list[tuple[np.ndarray, str, str]]:
    rng = np.random.default_rng(seed)
    return [render(rng, s.image) for _ in range(n)]


def dataset(cfg: MultimodalConfig, samples: list, with_images: bool, loss_on: str = "answer"):
    """``(tokens [n,T], loss mask [n,T], answer position [n], task [n], media or None)``."""
    prompts, items, tasks = [], [], []
    for i, (pixels, colour, count) in enumerate(samples):
        task = ("colour", "count")[i % 2]
        head = [BOS, MEDIA_ID] if with_images else [BOS]
        prompts.append(head + list(QUESTIONS[task].encode()) + [ord(colour if task == "colour" else count)])
        items.append([[image_media(pixels, cfg.vision, f"sample {i}")]] if with_images else [])
        tasks.append(task == "count")
    tokens, lengths, media = build_inputs(prompts, items, cfg, pad_id=PAD)
    answer_at = lengths - 2  # the position whose next token is the answer
    if loss_on == "answer":
        mask = np.arange(tokens.shape[1])[None] == answer_at[:, None]
    else:  # every next text token (the question is fixed text: easy, and it dilutes the answer's gradient)
        mask = (np.arange(tokens.shape[1])[None] < lengths[:, None] - 1) & (tokens != MEDIA_ID)
    return tokens, mask, answer_at, np.array(tasks), (media if with_images else None)


def rows(tree, idx):
    return None if tree is None else jax.tree_util.tree_map(lambda a: a[idx], tree)


def train(cfg: MultimodalConfig, s: Settings, data, test, log) -> dict:
    model = MultimodalTransformer(cfg)
    tokens, mask, _, _, media = data
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(s.seed), tokens[:2], rows(media, slice(0, 2))))
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.lr, max(1, s.steps // 20), s.steps)
    opt = optax.adamw(schedule, weight_decay=0.01)
    params, opt_state = variables["params"], opt.init(variables["params"])

    def loss_fn(params, tokens, mask, media):
        logits = model.apply({**variables, "params": params}, tokens, media)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        m = mask[:, :-1]
        return (nll * m).sum() / m.sum()

    @jax.jit
    def step(params, opt_state, tokens, mask, media):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, media)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng, losses, t0 = np.random.default_rng(s.seed + 1), [], time.time()
    for i in range(s.steps):
        idx = rng.choice(len(tokens), s.batch, replace=False)
        params, opt_state, loss = step(params, opt_state, tokens[idx], mask[idx], rows(media, idx))
        losses.append(float(loss))
        if i % max(1, s.steps // 10) == 0 or i == s.steps - 1:
            log(f"  step {i:5d} loss {losses[-1]:.4f} ({time.time() - t0:.0f} s)")
        if s.eval_every and (i + 1) % s.eval_every == 0:
            log(f"  step {i + 1:5d} held-out {accuracy(model, {**variables, 'params': params}, test, s.batch)}")
    return {"losses": losses, "train_seconds": time.time() - t0,
            **accuracy(model, {**variables, "params": params}, test, s.batch)}


def accuracy(model, variables, test, batch: int) -> dict:
    tokens, _, answer_at, is_count, media = test
    forward = jax.jit(model.apply)
    correct = []
    for start in range(0, len(tokens), batch):
        idx = np.arange(start, min(start + batch, len(tokens)))
        logits = forward(variables, tokens[idx], rows(media, idx))
        pred = np.asarray(jnp.argmax(logits[np.arange(len(idx)), answer_at[idx]], -1))
        correct.append(pred == tokens[idx, answer_at[idx] + 1])
    correct = np.concatenate(correct)
    return {"accuracy_colour": float(correct[~is_count].mean()), "accuracy_count": float(correct[is_count].mean()),
            "accuracy": float(correct.mean())}


def run(s: Settings, out: Path, log=print) -> dict:
    cfg = make_cfg(s)
    log(f"devices: {jax.devices()}; settings: {s}")
    result = {"settings": dataclasses.asdict(s), "chance": 0.25}
    t0 = time.time()
    train_set, test_set = renders(s, s.train, s.seed), renders(s, s.test, s.seed + 1000)
    log(f"rendered {s.train + s.test} images in {time.time() - t0:.1f} s")
    for name, with_images in (("vision", True), ("text_only", False)):
        t0 = time.time()
        data, test = dataset(cfg, train_set, with_images, s.loss_on), dataset(cfg, test_set, with_images, s.loss_on)
        log(f"{name}: data {time.time() - t0:.1f} s, tokens {data[0].shape}")
        result[name] = train(cfg, s, data, test, log)
        log(f"{name}: accuracy colour {result[name]['accuracy_colour']:.3f} count {result[name]['accuracy_count']:.3f}")
    write(result, out)
    return result


def write(result: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_learns.json").write_text(json.dumps(result, indent=1))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in ("vision", "text_only"):
        a.plot(result[name]["losses"], label=name)
    where = "answer position" if result["settings"].get("loss_on") == "answer" else "text positions"
    a.set(xlabel="step", ylabel=f"next-token loss ({where})", title="training loss")
    a.legend()
    keys = ("accuracy_colour", "accuracy_count")
    x = np.arange(len(keys))
    for k, name in enumerate(("vision", "text_only")):
        b.bar(x + 0.38 * k, [result[name][key] for key in keys], 0.38, label=name)
    b.axhline(result["chance"], color="k", ls=":", label="chance")
    b.set(xticks=x + 0.19, xticklabels=["colour?", "count?"], ylim=(0, 1), title="held-out accuracy")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "vision_learns.png", dpi=110)
    s, v, t = result["settings"], result["vision"], result["text_only"]
    (out / "vision_learns.md").write_text(
        f"# vision_learns ({s['steps']} steps, batch {s['batch']}, {s['image']} px, {s['dtype']})\n\n"
        "| model | colour? | count? | train s |\n|---|---|---|---|\n"
        f"| with image | {v['accuracy_colour']:.3f} | {v['accuracy_count']:.3f} | {v['train_seconds']:.0f} |\n"
        f"| text only | {t['accuracy_colour']:.3f} | {t['accuracy_count']:.3f} | {t['train_seconds']:.0f} |\n\n"
        f"Chance is {result['chance']}; held-out set of {s['test']} samples.\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--loss_on", choices=("answer", "text"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    s = PRESETS[args.preset]
    if args.steps:
        s = dataclasses.replace(s, steps=args.steps)
    if args.loss_on:
        s = dataclasses.replace(s, loss_on=args.loss_on)
    run(s, args.out)


if __name__ == "__main__":
    main()
