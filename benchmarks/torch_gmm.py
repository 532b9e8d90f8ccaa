"""PyTorch peers of ``bench_moe``'s grouped matmul: ``torch._grouped_mm`` (PyTorch's grouped GEMM
for MoE on Hopper, a CUTLASS kernel) and the dense equal-group ``torch.bmm`` (cuBLAS: the
ceiling in PyTorch). They run on the JAX inputs (shared through DLPack) and are timed in the same
interleaved loop as the JAX calls: each call returns a ``Synced`` result, which
``jax.block_until_ready`` waits for. PyTorch is imported only when called (the GPU machine has it).
"""

import jax
import numpy as np


class Synced:
    """A PyTorch result; ``jax.block_until_ready`` calls ``block_until_ready`` on every leaf."""

    def __init__(self, value):
        self.value = value

    def block_until_ready(self):
        import torch

        torch.cuda.synchronize()
        return self

    def numpy(self):
        first = self.value[0] if isinstance(self.value, tuple) else self.value
        return first.float().cpu().numpy()


def torch_calls(lhs, rhs, group_sizes, cot) -> dict:
    """name -> (fwd, train, info): zero-argument calls on copies of the inputs; ``train`` returns
    the output with both gradients (the output kept, as in ``bench_moe.fwd_and_train``). The
    grouped GEMM is given the weights both as they are (``[E, K, N]``, N-major) and K-major (the
    layout of weights stored ``[E, N, K]``, as PyTorch MoE models keep them)."""
    import torch

    to_torch = lambda x: torch.from_dlpack(jax.block_until_ready(x)).clone()
    a, b, c = to_torch(lhs), to_torch(rhs), to_torch(cot)
    offs = torch.cumsum(to_torch(group_sizes), 0, dtype=torch.int32)
    e, m = b.shape[0], a.shape[0]
    k_major = b.transpose(1, 2).contiguous().transpose(1, 2)
    grouped = lambda x, w: torch._grouped_mm(x, w, offs=offs)
    dense = lambda x, w: torch.bmm(x.view(e, m // e, -1), w).view(m, -1)
    out = {}
    for name, fn, w in (("torch._grouped_mm", grouped, b), ("torch._grouped_mm_kmajor", grouped, k_major),
                        ("torch.bmm_dense", dense, b)):
        a_g, w_g = a.detach().requires_grad_(), w.detach().requires_grad_()

        def fwd(fn=fn, w=w):
            with torch.no_grad():
                return Synced(fn(a, w))

        def train(fn=fn, a_g=a_g, w_g=w_g):
            y = fn(a_g, w_g)
            return Synced((y,) + torch.autograd.grad(y, (a_g, w_g), c))

        out[name] = (fwd, train)
    return out


def add_torch_calls(row: dict, calls: dict, inputs, want) -> None:
    """Adds each PyTorch peer to ``calls`` (``(name, "fwd_ms" | "train_ms") -> (fn, args)``, the
    table's interleaved timing) with its error relative to ``want`` (ours) in ``row``; a peer that
    fails (no PyTorch, an older one without ``_grouped_mm``, a refused layout) is recorded there."""
    try:
        peers = torch_calls(*inputs)
    except Exception as ex:  # noqa: BLE001 (a missing peer is recorded, not fatal)
        row["torch"] = dict(error=repr(ex)[:500])
        return
    want = np.asarray(want, np.float64)
    for name, (fwd, train) in peers.items():
        try:
            got = np.asarray(fwd().block_until_ready().numpy(), np.float64)
            train().block_until_ready()
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            row[name] = dict(rel_vs_ours=None if name.endswith("_dense") else err)  # the dense: other math
            calls[(name, "fwd_ms")], calls[(name, "train_ms")] = (fwd, ()), (train, ())
        except Exception as ex:  # noqa: BLE001
            row[name] = dict(error=repr(ex)[:500])
