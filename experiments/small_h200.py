"""small() Kimi K3 (1.01 B parameters, 0.36 B active) trained on one H200 at the measured-fastest setting.

Purpose: the single-GPU configuration behind README's throughput line. Its step is what
`benchmarks/bench_train.py --batch 64 --micro 8 --remat none` timed: eight micro-batches of
8 × 4096 tokens per optimizer step, no rematerialisation, bf16 compute with fp32 master weights,
per-head Muon + AdamW, fp32 logits.
Measured (H200, jax 0.11.2, `benchmarks/RESULTS.md` stop 15): 1.98 s per step, 132k tokens/s,
30.3–30.4 % MFU, on uniform random tokens. This file's text run (the interpreter's standard
library through the byte tokenizer, packed with document ids) has not been run on the H200 yet:
its loss curve and any throughput change from document boundaries are unmeasured.
Differs from the baseline TrainConfig: small(), the stdlib corpus, 4096-token rows, batch 64 in 8
micro-batches, WSD schedule, checkpoints every 200 steps.
Run: ``python -m k3jax.train --config experiments/small_h200.py`` (``--set steps=…`` to shorten).
"""

import dataclasses

from k3jax.config import small
from k3jax.train.config import CheckpointConfig, DataConfig, ScheduleConfig, TrainConfig


def get_config() -> TrainConfig:
    return dataclasses.replace(
        TrainConfig(),
        model=small(),
        data=DataConfig(source="stdlib", seed=0),
        schedule=ScheduleConfig(kind="wsd", warmup_fraction=0.01, decay_fraction=0.2, final_lr_ratio=0.1),
        checkpoint=CheckpointConfig(dir="runs/small_h200/checkpoints", every_steps=200, keep_last=2, keep_best=1),
        steps=2000, batch_size=64, micro_batches=8, seq_len=4096, remat="none",
        log_every=10, log_dir="runs/small_h200",
    )
