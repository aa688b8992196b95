"""The benchmarks' input generators and overlap measure (they run on the CPU too; the
timing itself needs a GPU, `benchmarks/RESULTS.md`)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from benchmarks import bench_cpu, bench_train_step
from htree_jax.bench import correlated_inputs, head_shapes, input_kinds, inputs, overlap_row, parent_overlap


def train_tiny_lm_config(args) -> HTreeConfig:
    """The `HTreeConfig` the benchmark's `train_tiny_lm` arguments give."""
    return bench_train_step.train_tiny_lm.htree_config(args)


def test_correlated_inputs_are_an_ar1_latent_shared_by_q_and_k():
    B, T, H, H_kv, K, V = 2, 4096, 4, 2, 64, 32
    rho, noise = 0.99, 0.5
    q, k, v = correlated_inputs(T, seed=3, rho=rho, noise=noise, dtype=jnp.float32, shape=(B, T, H, H_kv, K, V))
    assert q.shape == (B, T, H, K) and k.shape == (B, T, H_kv, K) and v.shape == (B, T, H_kv, V)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    # Per feature: var(q) = 1 + noise^2; q and k share the latent: cov = 1 at lag 0, rho^d
    # at lag d (averaged over batch, positions and features).
    np.testing.assert_allclose(q.var(), 1 + noise**2, rtol=0.1)
    cov = lambda a, b: float(np.mean(a * b))
    np.testing.assert_allclose(cov(q[:, :, 0], k[:, :, 0]), 1.0, rtol=0.15)
    np.testing.assert_allclose(cov(q[:, 50:, 0], k[:, :-50, 0]), rho**50, rtol=0.2)
    # Every head carries the same latent plus its own noise: the difference is noise alone.
    np.testing.assert_allclose(np.var(q[:, :, 0] - k[:, :, 1]), 2 * noise**2, rtol=0.1)
    # Features are independent latents (averaged over 63 feature pairs: an AR(1) with
    # rho = 0.99 gives only ~40 effective samples per pair).
    assert abs(cov(q[:, :, 0, :-1], q[:, :, 0, 1:])) < 0.1
    assert abs(cov(v[:, 1:], v[:, :-1])) < 0.05  # values carry no structure
    # The default is the benchmarks' shape and bfloat16.
    assert correlated_inputs(16)[0].dtype == jnp.bfloat16


def test_parent_overlap_counts_the_union_of_neighbouring_lists():
    T, top_k, block = 64, 4, 4
    equal = np.broadcast_to(np.arange(top_k), (1, T, 1, top_k))
    assert parent_overlap(jnp.asarray(equal), block) == pytest.approx(1 / block)
    disjoint = (np.arange(T)[:, None] * top_k + np.arange(top_k))[None, :, None, :]
    assert parent_overlap(jnp.asarray(disjoint), block) == pytest.approx(1.0)
    padded = np.where(np.arange(top_k) < 2, disjoint, -1)  # -1 entries are not parents
    assert parent_overlap(jnp.asarray(padded), block) == pytest.approx(0.5)


def test_overlap_row_on_real_selections(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = correlated_inputs(150, shape=(1, 150, 4, 2, 16, 16), dtype=jnp.float32)
    _, selected = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    row = overlap_row("correlated", config, 150, selected)
    assert row.startswith("| correlated | 150 | 4 | parents of layer 1: ")
    assert "parents of layer 0 (bottom): " in row
    with pytest.raises(ValueError, match="--inputs must be random, correlated or both"):
        input_kinds("gaussian")


def test_packed_bench_documents():
    """`--packed`: document lengths (equal, random) and the dense baseline's padded batch."""
    import numpy as np

    from htree_jax.bench import document_lengths, padded_documents

    assert document_lengths(131072, 8, True) == [16384] * 8
    lengths = document_lengths(1000, 8, False)
    assert sum(lengths) == 1000 and len(lengths) == 8 and min(lengths) >= 1
    x = np.arange(10, dtype=np.float32).reshape(1, 10, 1)
    docs = np.asarray(padded_documents(x, [3, 7]))
    assert docs.shape == (2, 128, 1)
    np.testing.assert_array_equal(docs[0, :7, 0], [0, 1, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(docs[1, :7, 0], [3, 4, 5, 6, 7, 8, 9])


def test_profile_names_a_profiler_for_every_pass_and_refuses_the_rest(capsys):
    """`python -m benchmarks.profile`: each pass (and the MLA decode) has its profiler;
    `--shape mla` with another pass is refused before anything runs."""
    from benchmarks import profile
    from benchmarks.profiling import decode_mla, one_layer

    assert profile.PROFILERS[("decode", "mla")] is decode_mla
    assert profile.PROFILERS[("one-layer", "benchmark")] is one_layer
    assert {p for p, _ in profile.PROFILERS} == {"forward", "backward", "decode", "one-layer", "block-backward",
                                                      "account"}
    with pytest.raises(SystemExit):
        profile.main(["--pass", "forward", "--shape", "mla"])
    assert "--shape mla is profiled with --pass decode only" in capsys.readouterr().err


def test_the_block_backward_profile_adds_up_its_pieces_interpreted(capsys, monkeypatch):
    """`--pass block-backward` on the CPU (its Pallas-Triton walk and sums interpreted, a
    small T in two chunks): every piece is timed and the rest is what they leave."""
    from benchmarks import profile
    from htree_jax import bench

    small = lambda T: tuple(x[:, :, :4] if i == 0 else x[:, :, :1] for i, x in enumerate(bench.inputs(T)))
    monkeypatch.setitem(bench.INPUTS, "random", small)
    profile.main(["--pass", "block-backward", "--T", "600", "--top-k", "8", "--budgets", "0.0001", "--iters", "1",
                  "--interpret"])
    out = capsys.readouterr().out
    assert "pallas_triton walk" in out and "chunks; backward" in out and "the rest" in out


def test_the_cpu_benchmark_times_the_default_against_dense(tmp_path):
    """`benchmarks/bench_cpu.py`: a row per size (the default and dense attention with
    RoPE, the ratio) and the first call of an oversized `top_k`, written as JSON."""
    out = tmp_path / "cpu.json"
    rows = bench_cpu.main(["--sizes", "64,128", "--iters", "1", "--oversized-top-k", "4096", "--out", str(out)])
    assert [(r["what"], r["T"]) for r in rows] == [("HTreeConfig() against dense with RoPE", 64),
                                                   ("HTreeConfig() against dense with RoPE", 128),
                                                   ("first call, top_k=4096", 64)]
    assert rows[0]["htree_over_dense"] == pytest.approx(rows[0]["htree_ms"] / rows[0]["dense_ms"])
    assert json.loads(out.read_text()) == rows and "| first call, top_k=4096 | 64 |" in bench_cpu.table(rows)


def test_head_shapes_read_whole_groups_and_refuse_the_rest():
    assert head_shapes("32/4,32/8,4/1") == [(32, 4), (32, 8), (4, 1)]
    for bad in ("32/5", "32", "32/0", "a/b", ""):
        with pytest.raises(ValueError, match="--shapes"):
            head_shapes(bad)
    q, k, v = inputs(64, heads=(8, 2))
    assert q.shape == (1, 64, 8, 128) and k.shape == v.shape == (1, 64, 2, 128)
    q, k, v = correlated_inputs(64, heads=(4, 1))
    assert q.shape == (1, 64, 4, 128) and k.shape == (1, 64, 1, 128)


def test_the_training_step_benchmark_times_dense_and_htree_in_one_call(tmp_path, monkeypatch):
    """`benchmarks/bench_train_step.py` (a small model in its table's place): a row per
    model, length and input kind, both attentions timed, their ratio, written as JSON."""
    monkeypatch.setitem(bench_train_step.MODELS, "frontier", dict(d_model=64, layers=1, heads=4, kv_heads=1))
    out = tmp_path / "step.json"
    rows = bench_train_step.main(["--models", "frontier", "--sizes", "256", "--inputs", "random,text",
                                  "--top-k", "2", "--iters", "1", "--commit", "abc", "--json", str(out)])
    assert [(r["model"], r["T"], r["inputs"], r["heads"], r["kv_heads"]) for r in rows] == [
        ("frontier", 256, "random", 4, 1), ("frontier", 256, "text", 4, 1)]
    assert all(r["dense_over_htree"] == pytest.approx(r["dense_ms"] / r["htree_ms"]) and r["commit"] == "abc"
               for r in rows)
    assert json.loads(out.read_text()) == rows and "| frontier (d64, 1 layers) | 4 / 1 | 256 | text |" in \
        bench_train_step.table(rows)
    args = bench_train_step.model_args("frontier", 256, 1, "htree", 2)
    assert train_tiny_lm_config(args) == HTreeConfig(top_k=2)
    with pytest.raises(SystemExit, match="--models"):
        bench_train_step.parse_args(["--models", "llama"])
