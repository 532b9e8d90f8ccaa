"""Train 2 steps, then resume the same run with ``steps=5``, in one process with a fresh persistent
compilation cache; print JSON: the train step's cache hits / misses per phase and the logged LRs.

    python -m tests.k3jax.train.horizon_worker TMP
"""

import dataclasses
import json
import logging
import sys
from pathlib import Path


class _CacheEvents(logging.Handler):
    """Records JAX's persistent-cache hit / miss log lines for the train step's module."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.events = []

    def emit(self, record):
        text = record.getMessage().lower()
        if "'jit_train_step'" in text and "persistent compilation cache" in text:
            self.events.append("hit" if " hit " in text else "miss")


def main(tmp: Path) -> None:
    from k3jax.compile_cache import enable_compilation_cache

    enable_compilation_cache(str(tmp / "jax_cache"), min_compile_seconds=0.0)
    from k3jax.train.config import CheckpointConfig
    from k3jax.train.loop import train
    from tests.k3jax.train.toy import micro_train_config

    handler = _CacheEvents()
    logger = logging.getLogger("jax._src.compiler")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    out = {}
    for phase, steps in (("first", 2), ("resumed", 5)):
        handler.events = []
        cfg = micro_train_config(steps=steps, log_every=1, log_dir=str(tmp / phase), tensorboard=False,
                                 checkpoint=CheckpointConfig(dir=str(tmp / "ckpt"), every_steps=2))
        train(cfg, progress=False)
        rows = [json.loads(line) for line in (tmp / phase / "metrics.jsonl").read_text().splitlines()]
        out[phase] = {"cache": handler.events, "lr": {r["step"]: r["lr"] for r in rows},
                      "schedule": dataclasses.asdict(cfg.schedule), "peak": cfg.optimizer.learning_rate}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
