"""The trace helpers the launch account stands on (`htree_jax/kernel_trace.py`,
`benchmarks/profiling/account.py`): busy time and span from launches, the HLO's names
and sources, the op paths the account groups XLA's kernels by."""

from __future__ import annotations

import pytest

from benchmarks.profiling.account import attribute, op_path
from htree_jax.kernel_trace import busy_span, hlo_sources, kernel_times


def test_busy_time_counts_overlapping_launches_once_and_the_span_each_step_apart():
    # Step 1: [0, 15) and [20, 25) (two streams overlap on [5, 10)); step 2 after a pause: [3e6, 3e6 + 10).
    events = [("a", 0, 10), ("b", 5, 10), ("c", 20, 5), ("a", 3_000_000, 10)]
    busy, span = busy_span(events, steps=2)
    assert busy == pytest.approx((20 + 10) / 2 / 1e3)
    assert span == pytest.approx((25 + 10) / 2 / 1e3)
    times = kernel_times(None, 2, events=events)
    assert times["a"] == pytest.approx((0.01, 1.0)) and times["c"] == pytest.approx((0.0025, 0.5))


def test_the_hlo_gives_each_kernel_its_shape_op_and_source_under_both_spellings():
    text = ('  %loop_select_fusion.2 = bf16[4,8]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused, '
            'metadata={op_name="jit(f)/transpose(jvp(jit(attend)))/htree_push_down/select_n" '
            'source_file="/x/y.py" source_line=12}\n'
            '  ROOT %tuple.1 = (bf16[4,8]{1,0}) tuple(%loop_select_fusion.2)\n')
    sources = hlo_sources(text)
    entry = ("bf16[4,8]{1,0}", "jit(f)/transpose(jvp(jit(attend)))/htree_push_down/select_n", "/x/y.py:12")
    assert sources["loop_select_fusion.2"] == entry and sources["loop_select_fusion_2"] == entry
    assert "tuple.1" not in sources  # no metadata: nothing to say


def test_xla_kernels_group_by_the_librarys_scope_and_the_rest_by_name():
    assert op_path("jit(f)/transpose(jvp(jit(attend)))/htree_sums/add.3") == "htree_sums: add."
    assert op_path("jit(f)/a/b/c/d/e/convert_element_type") == "c/d/e/convert_element_type"
    sources = {"fusion_1": ("", "jit(f)/x/htree_walk/dynamic_slice", ""),
               "fusion_2": ("", "jit(f)/x/htree_walk/dynamic_slice", "")}
    groups = attribute({"fusion_1": (3.0, 1.0), "fusion_2": (2.0, 2.0), "_walk_kernel": (40.0, 4.0)}, sources)
    assert groups["XLA htree_walk: dynamic_slice"][:2] == [5.0, 3.0]
    assert groups["kernel _walk_kernel"][:2] == [40.0, 4.0]


def test_the_account_runs_end_to_end_and_does_not_claim_to_close_without_a_gpu(tmp_path):
    """`--pass account` on the CPU: the call timed and written; no GPU trace, so no launch
    is counted and the account says it does not close (a GPU run's figures only)."""
    import json

    from benchmarks import profile

    out = tmp_path / "account.json"
    assert profile.main(["--pass", "account", "--shapes", "4/1", "--sizes", "512", "--iters", "1", "--steps", "1",
                         "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["H"], row["H_kv"], row["T"]) == (4, 1, 512) and row["wall_ms"] > 0
    assert row["launches"] == 0 and row["closes"] is False
