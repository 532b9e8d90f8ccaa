"""Sharded and multi-process conversion of the oracle: every process reads only its shards' bytes.

8 fake devices in one process (mesh data=2 x expert=4): every block is read once (replicas share
the read), the restore equals ``load_hf`` bit for bit with the model's shardings, and (slow) the
sharded forward gives identical logits. Two processes under ``jax.distributed`` (4 devices each,
mesh expert=8): each reads at most the replicated tensors plus its half of the experts (the
dense weights are split over ``expert`` too where they divide), and together they read everything.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from k3jax.convert.hf_config import from_hf_config
from k3jax.convert.safetensors_io import SafetensorsReader
from tests.sharding import multidevice

ORACLE = "/work/shared/oracle/tiny_a"
VARIANTS = ("hf_bf16", "hf_mxfp4")


def test_eight_devices_read_each_block_once_and_restore_bitwise():
    out = multidevice.run_worker("tests.k3jax.convert.sharded_worker")
    for variant in VARIANTS:
        r = out[variant]
        assert r["bytes_read"] == _share(variant, 1), (variant, r)
        assert r["checkpoint_bytes"] - r["bytes_read"] == _a_log_padding(variant)
        assert r["bitwise"] and r["shardings"], (variant, r)
        assert r["w1_spec"].startswith("P('expert',") and r["w1_shard_shape"] == [4, 32, 32], r
    scanned = out["hf_mxfp4_scanned"]  # stacked leaves: the same bytes, the layers axis unsharded
    assert scanned["bytes_read"] == _share("hf_mxfp4", 1) and scanned["bitwise"] and scanned["shardings"], scanned
    assert scanned["w1_spec"].startswith("P(None, 'expert',") and scanned["w1_shard_shape"] == [2, 4, 32, 32], scanned


@pytest.mark.slow  # compiles the forward on the mesh and on one device (~2 min on 2 cores)
def test_eight_devices_logits_identical(monkeypatch):
    monkeypatch.setenv("K3JAX_CONVERT_LOGITS", "1")
    r = multidevice._run("tests.k3jax.convert.sharded_worker", timeout=900)["hf_mxfp4"]
    assert r["logits_identical"], r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _a_log_padding(variant: str) -> int:
    """Bytes of K3's A_log zero padding (never read: the tree drops it)."""
    heads = from_hf_config(f"{ORACLE}/{variant}").kda.num_heads
    infos = SafetensorsReader(f"{ORACLE}/{variant}").infos
    return sum((i.shape[0] - heads) * i.dtype.itemsize for k, i in infos.items() if k.endswith(".A_log"))


def _share(variant: str, processes: int) -> int:
    """Bytes one process must read: every replicated tensor, and its part of the tensors with an
    experts axis (the routed experts, the router and its balancing bias), split over ``expert``."""
    infos = SafetensorsReader(f"{ORACLE}/{variant}").infos
    experts = sum(i.end - i.begin for k, i in infos.items() if ".experts." in k or ".block_sparse_moe.gate." in k)
    total = sum(i.end - i.begin for i in infos.values()) - _a_log_padding(variant)
    return total - experts + experts // processes


def test_two_processes_convert_and_restore_reading_only_their_part(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", K3JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}",
               K3JAX_NUM_PROCESSES="2", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(multidevice.ROOT), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.k3jax.convert.multiprocess_worker", str(tmp_path)],
                              cwd=multidevice.ROOT, env=dict(env, K3JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
        assert p.returncode == 0 and lines, stdout[-2000:] + stderr[-4000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    assert sorted(r["process"] for r in results) == [0, 1] and all(r["processes"] == 2 for r in results)
    for variant in VARIANTS:
        whole = _share(variant, 1)  # the checkpoint's bytes less A_log's padding
        for r in results:
            assert r[variant]["shards_match"], (variant, r)
            # The training tables split the experts and, where a dim divides, the dense weights over
            # `expert` (sharding/rules.py): each process reads at most the replicated tensors plus its
            # half of the experts, and less than the whole checkpoint.
            assert r[variant]["bytes_read"] <= _share(variant, 2) < whole, (variant, r, _share(variant, 2))
        # Every byte is read by some process (the exact once-per-block count is the 8-device test's).
        assert sum(r[variant]["bytes_read"] for r in results) >= whole, (variant, results)
