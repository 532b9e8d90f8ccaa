"""Subprocess for the exact-resume test: ``python -m tests.k3jax.train.resume_worker MODE CKPT_DIR OUT``.

MODE "straight": train 20 steps; "stop_at_10": train, and once the step-10 checkpoint is on disk
print READY and hang (the test SIGKILLs it); "resume": train to 20 from CKPT_DIR. Every batch the
process consumes is appended to OUT/batches.txt (a hash) and final params go to OUT/params.npz.
"""

import hashlib
import sys
import time
from pathlib import Path

import jax
import numpy as np

from tests.k3jax.train import toy


def main(mode: str, ckpt_dir: str, out: str) -> None:
    toy.use_compilation_cache()
    from k3jax.train import loop
    from k3jax.train.config import CheckpointConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = toy.micro_train_config(checkpoint=CheckpointConfig(dir=ckpt_dir, every_steps=10, keep_last=3,
                                                             async_save=True))
    make_data = loop.make_data

    class Logged:
        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            batch = next(self.inner)
            digest = hashlib.sha256(b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch)))
            with (out / "batches.txt").open("a") as f:
                f.write(digest.hexdigest() + "\n")
            return batch

        def __getattr__(self, name):
            return getattr(self.inner, name)

    loop.make_data = lambda c: Logged(make_data(c))

    def on_step(step, state, ckpt):
        if mode == "stop_at_10" and step == 10:
            ckpt.wait()
            print("READY", flush=True)
            time.sleep(600)

    result = loop.train(cfg, progress=False, on_step=on_step)
    flat = {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(result.state))[0]}
    np.savez(out / "state.npz", **flat)


if __name__ == "__main__":
    main(*sys.argv[1:4])
