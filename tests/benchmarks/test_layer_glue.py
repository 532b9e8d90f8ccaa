"""benchmarks/layer_glue.py: the bytes of a fusion, gathers counted at what they read."""

from benchmarks.layer_glue import glue, groups

HLO = """
%fused_gather (param_0: f32[4096,163840], param_1: s32[4096,2]) -> f32[4096] {
  %param_0 = f32[4096,163840]{1,0} parameter(0)
  %param_1 = s32[4096,2]{1,0} parameter(1)
  %gather.1 = f32[4096,1,1]{2,1,0} gather(%param_0, %param_1), offset_dims={1,2}, slice_sizes={1,1}
  ROOT %bitcast.1 = f32[4096]{0} bitcast(%gather.1)
}

%fused_add (param_0.1: f32[4096,163840], param_1.1: f32[4096,163840]) -> f32[4096,163840] {
  %param_0.1 = f32[4096,163840]{1,0} parameter(0)
  %param_1.1 = f32[4096,163840]{1,0} parameter(1)
  ROOT %add.1 = f32[4096,163840]{1,0} add(%param_0.1, %param_1.1)
}

ENTRY %main (p0: f32[4096,163840], p1: s32[4096,2]) -> f32[4096] {
  %p0 = f32[4096,163840]{1,0} parameter(0)
  %p1 = s32[4096,2]{1,0} parameter(1)
  %loop_add_fusion = f32[4096,163840]{1,0} fusion(%p0, %p0), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/layers_0/add"}
  ROOT %loop_gather_fusion = f32[4096]{0} fusion(%loop_add_fusion, %p1), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(f)/layers_1/add"}
}
"""


def test_gathered_operand_counts_the_rows_read_and_groups_sum_layers():
    rows = {r["name"]: r for r in glue(HLO)}
    logits = 4096 * 163840 * 4
    assert rows["loop_add_fusion"]["bytes"] == 3 * logits
    # one fp32 per row read from the logits, the [4096, 2] indices, the [4096] output
    assert rows["loop_gather_fusion"]["bytes"] == 4096 * 4 + 4096 * 2 * 4 + 4096 * 4
    grouped = groups(list(rows.values()))  # one group per source, kind and output shape
    assert {g["op_name"] for g in grouped} == {"jit(f)/layers_N/add"}
    assert [g["layers"] for g in grouped] == [{"0"}, {"1"}]  # largest first
    assert sum(g["bytes"] for g in grouped) == sum(r["bytes"] for r in rows.values())
