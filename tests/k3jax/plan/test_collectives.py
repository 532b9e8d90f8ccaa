"""Communication readout (k3jax/plan/collectives.py) on hand-written HLO in XLA:TPU's printed form."""

from k3jax.plan.collectives import volume_per_axis

MESH = {"data": 1, "fsdp": 1, "expert": 2, "sequence": 1, "tensor": 4}
GATHER = ("  %all-gather.1 = bf16[4,1024]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=1, replica_groups="
          "mesh['data'=1,'fsdp'=1,'expert'=2,'sequence'=1,'tensor'=4] {'tensor'}, dimensions={0}\n")


def _loop_program(condition: str, while_config: str = "") -> str:
    return ("%body (param: (s32[], bf16[1,1024])) -> (s32[], bf16[1,1024]) {\n"
            "  %p = bf16[1,1024]{1,0} parameter(0)\n" + GATHER
            + "  ROOT %t = (s32[], bf16[1,1024]) tuple(%i, %p)\n}\n\n"
            "%cond (param.1: (s32[], bf16[1,1024])) -> pred[] {\n" + condition + "}\n\n"
            "ENTRY %main (a: bf16[1,1024]) -> bf16[1,1024] {\n"
            "  %w = (s32[], bf16[1,1024]) while(%init), condition=%cond, body=%body" + while_config + "\n"
            "  ROOT %r = bf16[1,1024]{1,0} get-tuple-element(%w), index=1\n}\n")


def test_a_scan_loop_counts_each_iteration():
    """XLA:TPU's compiled loops carry no known_trip_count: the bound comes from the condition
    ``i < 22`` (the scanned stack's 22 units were counted once, undercounting K3's decode 10-fold)."""
    once = 3 / 4 * 4 * 1024 * 2  # all-gather of a bf16[4, 1024] result over 4 devices
    cond = ("  %constant.7.clone.1 = s32[]{:T(128)} constant(22)\n"
            "  %param.1 = (s32[]{:T(128)}, bf16[1,1024]{1,0}) parameter(0)\n"
            "  %gte.2 = s32[]{:T(128)} get-tuple-element(%param.1), index=0\n"
            "  ROOT %lt.3 = pred[]{:T(512)} compare(%gte.2, %constant.7.clone.1), direction=LT\n")
    assert volume_per_axis(_loop_program(cond), MESH) == {"tensor": 22 * once}
    # the compiled form names the counter as a tuple element of the parameter (K3's full decode)
    element = ("  %constant.3911.clone.1 = s32[]{:T(128)} constant(22)\n"
               "  %wide.param.73 = (s32[]{:T(128)}, bf16[1,1024]{1,0}) parameter(0)\n"
               "  ROOT %lt.3120 = pred[]{:T(512)} compare(%wide.param.73#0, %constant.3911.clone.1), direction=LT\n")
    assert volume_per_axis(_loop_program(element), MESH) == {"tensor": 22 * once}
    known = ', backend_config={"known_trip_count":{"n":"5"}}'
    assert volume_per_axis(_loop_program(cond, known), MESH) == {"tensor": 5 * once}
    # a data-dependent bound (expert parallel's overflow rounds): one iteration
    dynamic = ("  %param.1 = (s32[]{:T(128)}, bf16[1,1024]{1,0}) parameter(0)\n"
               "  %gte.2 = s32[]{:T(128)} get-tuple-element(%param.1), index=0\n"
               "  %gte.4 = s32[]{:T(128)} get-tuple-element(%param.1), index=2\n"
               "  ROOT %lt.3 = pred[]{:T(512)} compare(%gte.2, %gte.4), direction=LT\n")
    assert volume_per_axis(_loop_program(dynamic), MESH) == {"tensor": once}


def test_a_collective_in_an_async_sparsecore_computation_counts():
    """TPU7x runs some gathers on its SparseCores: the computation holding the all-gather ends with
    ``}, execution_thread="sparsecore"``, which ended no computation in the readout, so everything
    after it was lost (K3's TPU7x decode showed no ``tensor`` traffic; it sends 37 GB a step)."""
    hlo = ("%called (p: bf16[1,1024]) -> bf16[4,1024] {\n" + GATHER.replace("ROOT", "") + "}\n\n"
           "%async (p.1: bf16[1,1024]) -> bf16[4,1024] {\n"
           "  %p.1 = bf16[1,1024]{1,0} parameter(0)\n"
           "  ROOT %c = bf16[4,1024]{1,0} call(%p.1), to_apply=%called\n"
           "}, execution_thread=\"sparsecore\"\n\n"
           "%after (p.2: bf16[1,1024]) -> bf16[4,1024] {\n" + GATHER + "}\n\n"
           "ENTRY %main (a: bf16[1,1024]) -> bf16[4,1024] {\n"
           "  %s = ((bf16[1,1024]), bf16[4,1024], u32[]) async-start(%a), async_execution_thread=\"sparsecore\", "
           "calls=%async\n"
           "  %d = bf16[4,1024]{1,0} async-done(%s)\n"
           "  ROOT %w = (s32[], bf16[1,1024]) while(%init), condition=%cond, body=%after, "
           'backend_config={"known_trip_count":{"n":"3"}}\n}\n')
    assert volume_per_axis(hlo, MESH) == {"tensor": (1 + 3) * 3 / 4 * 4 * 1024 * 2}  # the loop body 3 times
