"""benchmarks/decode_kernels.py's count of the kernels on a program's longest dependency chain, on a
hand-written optimized-HLO text: independent kernels side by side count once, a loop its trip count
times its body's chain, free instructions (tuples, bitcasts, parameters) nothing."""

from benchmarks.decode_kernels import chain, computations, kernels, step_body

HLO = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%f, metadata={op_name="a"}
  %b = f32[8]{0} fusion(%x), kind=kLoop, calls=%f, metadata={op_name="b"}
  %c = f32[8]{0} fusion(%a), kind=kLoop, calls=%f, metadata={op_name="c"}
  %bc = f32[8]{0} bitcast(%c)
  %d = f32[8]{0} fusion(%bc, %b), kind=kLoop, calls=%f, metadata={op_name="d"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]) tuple(%i, %d)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%z, %x)
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""

COND = """
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  ROOT %more = pred[] fusion(%x), kind=kLoop, calls=%f, metadata={op_name="cond"}
}
"""


def test_chain_counts_dependent_kernels_only():
    comps, entry = computations(HLO)
    assert step_body(comps) == "body"
    assert chain(comps, "body") == 3  # a -> c -> d; b beside a
    assert [row[2] for row in chain(comps, "body", path=True)] == ["a", "c", "d"]
    assert chain(comps, entry) == 12  # four trips of the body


def test_a_loop_of_unknown_length_runs_the_steps_given():
    """``generate``'s loop ends on the tokens, so XLA knows no trip count: the top-level loop counts
    ``unknown_trips`` times (its condition once more), a known count still wins."""
    comps, entry = computations(HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
                                + COND)
    assert chain(comps, entry) == 3 and chain(comps, entry, unknown_trips=64) == 192
    ks = kernels(comps, entry, unknown_trips=64)
    assert sum(k.count for k in ks) == 4 * 64 + 65  # a, b, c, d each trip; the condition's compare each test
    known, _ = computations(HLO + COND)
    assert chain(known, "main", unknown_trips=64) == 12
