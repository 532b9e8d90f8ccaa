"""``python -m k3jax.train.demo``: tiny() K3 learns multi-query associative recall on the CPU.

1. Train ``experiments/demo_recall.py`` (progress bar; checkpoints and ``metrics.jsonl`` in a fresh
   run directory, ``--dir`` to choose it).
2. Reload the last checkpoint into a new trainer and check it equals the trained state bit for bit.
3. Report recall accuracy on held-out rows (another data seed) against chance, and show examples.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from k3jax import cli
from k3jax.train.__main__ import load_config
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.loop import train
from k3jax.train.recall import FIRST_KEY, RecallBatches, recall_accuracy
from k3jax.train.step import Trainer

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "demo_recall.py"
HELD_OUT_SEED = 1_000_003


def _name(token: int, num_keys: int) -> str:
    return f"k{token - FIRST_KEY}" if token < FIRST_KEY + num_keys else f"v{token - FIRST_KEY - num_keys}"


def show_example(tokens, predictions, cfg) -> str:
    """``k3:v17 k9:v2 … | k9→v2 ✓ k3→v5 ✗(v17)`` for one row."""
    r = cfg.data.recall
    pairs = " ".join(f"{_name(tokens[1 + 2 * i], r.num_keys)}:{_name(tokens[2 + 2 * i], r.num_keys)}"
                     for i in range(r.num_pairs))
    answers = []
    for j in range(r.num_queries):
        pos = 1 + 2 * r.num_pairs + 2 * j
        key, truth, guess = tokens[pos], tokens[pos + 1], predictions[pos]
        mark = "✓" if guess == truth else f"✗(want {_name(truth, r.num_keys)})"
        answers.append(f"{_name(key, r.num_keys)}→{_name(guess, r.num_keys) if guess >= FIRST_KEY else '?'} {mark}")
    return f"  context: {pairs}\n  queries: {'  '.join(answers)}"


def evaluate(trainer: Trainer, state, cfg, batches: int) -> tuple[float, dict, np.ndarray]:
    """Accuracy over ``batches`` held-out batches; returns the last batch and its predictions."""
    data = RecallBatches(cfg.data.recall, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, HELD_OUT_SEED)
    variables = trainer.model_variables(state)
    forward = jax.jit(lambda v, t, s: trainer.model.apply(v, t, segment_ids=s))
    correct = total = 0
    for _ in range(batches):
        batch = next(data)
        logits = np.asarray(forward(variables, batch["tokens"], batch["segment_ids"]))
        n = int(batch["loss_mask"].sum())
        correct += recall_accuracy(logits, batch) * n
        total += n
    return correct / total, batch, logits.argmax(-1)


def main(argv=None) -> int:
    p = cli.make_parser("python -m k3jax.train.demo", __doc__)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="experiment file (default: the recall demo)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted path, typed by the field; repeatable")
    p.add_argument("--dir", default=None, help="run directory (default: a fresh temporary one)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches to measure accuracy on")
    p.add_argument("--examples", type=int, default=3, help="solved examples to show")
    args = p.parse_args(argv)
    return cli.run(lambda: _demo(args), debug=args.debug)


def _demo(args) -> int:
    from k3jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()
    cfg = load_config(args.config, args.assignments)
    run = Path(args.dir or tempfile.mkdtemp(prefix="k3jax_demo_"))
    cfg = dataclasses.replace(cfg, log_dir=str(run), checkpoint=dataclasses.replace(
        cfg.checkpoint, dir=str(run / "checkpoints")))
    r = cfg.data.recall
    print(f"k3jax demo: {cfg.model.name} K3 on associative recall ({r.num_pairs} pairs, {r.num_queries} queries, "
          f"{r.num_values} values; chance {1 / r.num_values:.1%}); {cfg.steps} steps of {cfg.batch_size} rows; "
          f"run dir {run}", flush=True)
    t0 = time.perf_counter()
    result = train(cfg)
    print(f"trained {int(result.state.step)} steps in {time.perf_counter() - t0:.0f} s; "
          f"last training loss {float(result.last_metrics['loss']):.3f}", flush=True)

    trainer = Trainer(cfg)
    restored = Checkpointer(cfg.checkpoint, cfg).restore(trainer.abstract_state())
    if restored is None:
        print("error: no checkpoint to reload", file=sys.stderr)
        return 1
    state, _, step = restored
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(state)),
                                                    jax.tree.leaves(jax.device_get(result.state))))
    print(f"reloaded checkpoint step {step} from {cfg.checkpoint.dir}: identical to the trained state: {same}")

    accuracy, batch, predictions = evaluate(trainer, state, cfg, args.eval_batches)
    queries = args.eval_batches * cfg.batch_size * r.num_queries
    print(f"recall accuracy on {queries} held-out queries: {accuracy:.1%} (chance {1 / r.num_values:.1%})")
    for i in range(min(args.examples, cfg.batch_size)):
        print(f"example {i + 1}:\n{show_example(batch['tokens'][i], predictions[i], cfg)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
