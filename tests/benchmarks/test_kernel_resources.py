"""benchmarks/kernel_resources.py: ptxas's per-entry numbers and the PTX counts, parsed (no GPU, no
toolkit: a stand-in ptxas prints the log format of CUDA 13's ``ptxas -v``)."""

import stat

from benchmarks import kernel_resources

PTX = """//
.version 8.8
.target sm_90a
.visible .entry gather(
\t.param .u64 p0
)
{
\tld.global.b32 {%r1}, [%rd1];
\tld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd2];
\tbar.sync \t0;
\tld.global.v4.b32 {%r6, %r7, %r8, %r9}, [%rd3];
\tst.global.b32 [%rd4], %r1;
}
.visible .entry dense(
\t.param .u64 p0
)
{
\tcp.async.cg.shared.global [%r1], [%rd1], 16;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd5, %rd6, 1, 1, 1, 0, 1;
\tbar.sync \t0;
}
"""

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dense' for 'sm_90a'
ptxas info    : Function properties for dense
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
ptxas info    : Compiling entry function 'gather' for 'sm_90a'
ptxas info    : Function properties for gather
    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""


def test_entries_and_their_resources(tmp_path):
    (tmp_path / "module.ptx").write_text(PTX)
    (tmp_path / "log").write_text(LOG)
    ptxas = tmp_path / "ptxas"
    ptxas.write_text(f"#!/bin/sh\ncat {tmp_path / 'log'} >&2\n")
    ptxas.chmod(ptxas.stat().st_mode | stat.S_IEXEC)
    table = kernel_resources.resources(tmp_path, str(ptxas))
    assert table["gather"] == {"registers": 255, "stack": 8, "spill_stores": 12, "spill_loads": 4,
                               "ld.global": 3, "cp.async": 0, "wgmma": 0, "bar.sync": 1, "ld<bar": 2}
    assert table["dense"] == {"registers": 96, "stack": 0, "spill_stores": 0, "spill_loads": 0,
                              "ld.global": 0, "cp.async": 1, "wgmma": 1, "bar.sync": 1, "ld<bar": 0}
