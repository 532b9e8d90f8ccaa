"""A corrupt newest checkpoint, met the way a user meets it: ``python -m k3jax.train`` writes steps 1
and 2; step 2 is damaged; resuming falls back to step 1 with one warning line, trains to step 2
and saves it again (the corrupt step, moved aside, does not block that save); the new step 2 is
damaged another way and ``python -m k3jax.generate`` on the run folder falls back as well.
Each kind of damage is covered at the `Checkpointer` level in ``test_checkpoint.py``."""

import json

import pytest

from tests.k3jax.cli_run import run_cli
from tests.k3jax.train.test_checkpoint import corrupt

# A two-layer tiny() (KDA + dense, MLA + MoE) on the demo's recall task: compiles in seconds.
MICRO = ["model.num_layers=2", "batch_size=4", "seq_len=32", "log_every=1", "checkpoint.every_steps=1",
         "checkpoint.keep_last=3", "checkpoint.keep_best=0", "steps=2"]


def _train(run, *extra):
    sets = [f"--set={a}" for a in MICRO + [f"checkpoint.dir={run / 'checkpoints'}", f"log_dir={run}", *extra]]
    return run_cli(["-m", "k3jax.train", "--config", "experiments/demo_recall.py", "--no-progress", *sets])


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


@pytest.mark.slow  # four processes that each compile the micro model: ~1-2 min idle, 7 min on a loaded 2-core box
def test_train_resume_and_generate_fall_back_past_a_corrupt_step(tmp_path):
    run = tmp_path / "run"
    first = _train(run)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "compiling the train step" in first.stderr and "compiled and ran the first step in" in first.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2"]

    reason = corrupt(ckpts / "2", "array-data-truncated")
    resumed = _train(run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = _warnings(resumed.stderr)
    assert len(warnings) == 1 and "checkpoint step 2" in warnings[0] and f"({reason}:" in warnings[0], resumed.stderr
    assert f"resumed from step 1 ({ckpts / '1'})" in resumed.stderr
    assert len(resumed.stderr.splitlines()) < 20, resumed.stderr  # no orbax / TensorStore tracebacks
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["step"] == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2", "2.corrupt-arrays"]

    reason = corrupt(ckpts / "2", "metadata")
    gen = run_cli(["-m", "k3jax.generate", "--checkpoint", str(run), "--prompt", "k\x02",
                   "--max-new-tokens", "4", "--temperature", "0"])
    assert gen.returncode == 0, gen.stderr[-3000:]
    warnings = _warnings(gen.stderr)
    assert len(warnings) == 1 and f"({reason}:" in warnings[0], gen.stderr
    assert gen.stdout.startswith("k\\x02")  # the prompt, echoed with its control byte escaped
    assert not any(ord(c) < 32 and c not in "\n\t" for c in gen.stdout)
    assert (ckpts / "2.corrupt-metadata" / "reason.txt").is_file()
    again = run_cli(["-m", "k3jax.generate", "--checkpoint", str(ckpts), "--prompt", "k",
                     "--max-new-tokens", "2", "--temperature", "0"])
    assert again.returncode == 0 and _warnings(again.stderr) == [], again.stderr[-3000:]
