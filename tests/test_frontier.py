"""`benchmarks/frontier.py` on the CPU: two 2-step checkpoints scored with the reference
backend (every configuration, block selection included), the table and the picture from
quality rows beside speed rows, and the count's candidates against real selections."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import extension, extension_seed, frontier
from htree_jax import HTreeConfig, htree_attention
from htree_jax.introspect import candidates_per_query
from tests.test_examples import load_example, write_corpus


def test_frontier_scores_checkpoints_and_draws_the_table(tmp_path):
    example = load_example()
    corpus = tmp_path / "corpus"
    write_corpus(corpus, example)
    checkpoints = []
    for seed in (0, 1):
        checkpoints.append(str(tmp_path / f"seed{seed}"))
        example.main(["--data", str(corpus), "--attention", "dense", "--seq-len", "32", "--steps", "2", "--batch", "2",
                      "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--compression-rate",
                      "4", "--top-k", "2", "--eval-size", "2", "--no-progress", "--seed", str(seed),
                      "--save", checkpoints[-1]])
    out = tmp_path / "quality.json"
    rows = frontier.main(["--checkpoints", ",".join(checkpoints), "--eval-windows", "2", "--top-ks", "2,8",
                          "--block-top-ks", "2", "--rules", "bound,mean", "--backend", "reference", "--quality-only",
                          "--compression-rate", "4", "--out", str(out)])
    names = {r["config"] for r in rows}
    assert names == {"dense", "htree bound top_k=2 r=4", "htree bound top_k=8 r=4", "htree mean top_k=2 r=4",
                     "htree mean top_k=8 r=4", "block first bound top_k=2 r=4", "block previous bound top_k=2 r=4"}
    assert {r.get("compression_rate") for r in rows} == {None, 4}
    assert {r["T"] for r in rows} == {32, 128}  # the training length and 4x it
    assert len(rows) == len(names) * 2 * 2 and all(np.isfinite(r["bits"]) for r in rows)
    assert json.loads(out.read_text()) == rows
    # top_k=8 at T=32 with r=4 is one layer (M = 32): exact attention, dense's bits per byte
    dense = {(r["checkpoint"], r["T"]): r["bits"] for r in rows if r["config"] == "dense"}
    exact = [r for r in rows if r["config"] == "htree bound top_k=8 r=4" and r["T"] == 32]
    for r in exact:
        assert r["bits"] == pytest.approx(dense[(r["checkpoint"], 32)], rel=1e-5)

    # speed rows as a GPU run writes them, with the counted floor computed here
    configs = frontier.configurations([2, 8], ["bound", "mean"], ["first", "previous"], [2], ["bound"], 4)
    speed = [dict(kind="dense_speed", dense_ms={131072: {"forward": 100.0, "backward": 300.0}, 524288: {
        "forward": 1600.0}})]
    for c in configs[1:]:
        config = HTreeConfig(**c["fields"])
        assert config.compression_rate == 4 and config.selection_block == (4 if c.get("block") else 1)
        row = dict(kind="speed", config=c["name"], rule=c["rule"], top_k=config.top_k)
        for T, dense_ms in ((131072, 100.0), (524288, 1600.0)):
            counted = frontier.counted_ms(config, T, 300.0, 3.0)
            row[f"count_{T}"] = dict(counted, speedup=dense_ms / counted["floor_ms"])
        if not c.get("block"):
            row.update(forward_speedup=1.5, backward_speedup=1.2)
        speed.append(row)
    (tmp_path / "speed.json").write_text(json.dumps(speed))
    png = tmp_path / "frontier.png"
    frontier.main(["--merge", f"{out},{tmp_path / 'speed.json'}", "--png", str(png), "--compression-rate", "4"])
    assert png.stat().st_size > 10_000
    summary = frontier.summarize(rows + speed)
    text = frontier.table(summary, 131072, 524288)
    assert "| 32 | block first bound top_k=2 r=4 |" in text and "| - | - |" in text  # no kernel: counted only
    assert "bits/byte at the training length" in text and "bits/byte at 4x it" in text
    assert "1.50x | 1.20x" in text


def test_counted_candidates_equal_the_selections():
    """The count's candidates per query (each layer keeping min(top_k, n)) equal what the
    reference's selections give (`introspect.candidates_per_query`)."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    rng = np.random.default_rng(0)
    T = 150
    q, k, v = (rng.standard_normal((1, T, h, 8)).astype(np.float32) for h in (2, 1, 1))
    _, selected = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    from_selections = candidates_per_query(selected, config, T)[0, :, 0]
    np.testing.assert_array_equal(frontier.candidates_per_query(config, T).sum(axis=0), from_selections)


def test_the_count_favours_blocks_by_their_gathers():
    """Same FLOPs (first source), 16x fewer gathered bytes with a block of 16 queries."""
    per_query = frontier.counted_ms(HTreeConfig(top_k=256, selection_block=1), 131072, 300.0, 3.0)
    block = frontier.counted_ms(HTreeConfig(top_k=256, selection_block=16), 131072, 300.0, 3.0)
    assert block["flops"] == per_query["flops"]
    assert block["bytes"] < per_query["bytes"] / 8 and block["floor_ms"] < per_query["floor_ms"]


def test_adaptation_continues_a_dense_checkpoint_with_htree_and_scores_each_share(tmp_path):
    """`benchmarks/adaptation.py` on the CPU: a 4-step dense checkpoint continued with htree
    (reference backend) for 1 and 2 steps (shares 0.25, 0.5), scored on the frontier's
    windows beside the checkpoint's dense score; the curve over the continued run's held-out
    evaluations (`--eval-every`) and its last tenth."""
    from benchmarks import adaptation

    example = load_example()
    corpus = tmp_path / "corpus"
    write_corpus(corpus, example)
    result = example.main(["--data", str(corpus), "--attention", "dense", "--seq-len", "32", "--steps", "4",
                           "--batch", "2", "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                           "--compression-rate", "4", "--top-k", "2", "--eval-size", "2", "--no-progress",
                           "--eval-every", "2", "--save", str(tmp_path / "ck")])
    assert [step for step, _ in result["eval_curve"]] == [2, 4]
    assert result["last_tenth_change"] == pytest.approx(100 * (result["eval_curve"][1][1] / result["eval_curve"][0][1]
                                                              - 1))
    out = tmp_path / "adaptation.json"
    rows = adaptation.main(["--checkpoint", str(tmp_path / "ck"), "--top-ks", "2", "--shares", "0.25,0.5",
                            "--eval-windows", "2", "--backend", "reference", "--compression-rate", "4", "--control",
                            "--out", str(out)])
    control = [r for r in rows if r["config"] == "dense continued"]
    assert [(r["steps"], r["T"]) for r in control] == [(1, 32), (1, 128), (2, 32), (2, 128)]
    assert control[2]["bits"] != control[0]["bits"]
    rows = [r for r in rows if r not in control]
    assert [(r["steps"], r["T"]) for r in rows] == [(0, 32), (0, 128), (1, 32), (1, 128), (2, 32), (2, 128)]
    assert [r for r in json.loads(out.read_text()) if r["config"] != "dense continued"] == rows
    assert all(np.isfinite(r["bits"]) and r["change"] == pytest.approx(100 * (r["bits"] / r["dense_bits"] - 1))
               for r in rows)
    assert rows[4]["bits"] != rows[0]["bits"]  # the continued run changed the weights (its first step: lr 0)
    assert "| htree bound top_k=2 r=4 | 2 (50%) |" in adaptation.table(rows + control)
    assert "| dense continued | 2 (50%) |" in adaptation.table(rows + control)


def test_models_trained_at_different_lengths_are_not_averaged():
    rows = [dict(kind="quality", checkpoint=c, seed=0, train_len=L, config=name, rule=name.split()[0], top_k=None,
                 T=T, bits=bits, windows=8)
            for c, L, name, T, bits in (("a", 16, "dense", 16, 1.0), ("a", 16, "htree", 16, 1.1),
                                        ("b", 64, "dense", 64, 2.0), ("b", 64, "htree", 64, 2.4))]
    summary = frontier.summarize(rows)
    assert [(e["train_len"], e["config"]) for e in summary] == [(16, "dense"), (16, "htree"), (64, "dense"),
                                                                 (64, "htree")]
    assert summary[1]["lengths"][16]["change"] == pytest.approx(10.0)
    assert summary[3]["lengths"][64]["change"] == pytest.approx(20.0)
    assert "| 64 | htree |" in frontier.table(summary, 131072, 524288)


def test_the_frontier_scores_at_its_own_compression_rate_not_the_checkpoints():
    """A dense checkpoint's `--compression-rate` training flag shaped nothing (dense
    attention has no tree): the frontier's configurations carry their own, the library's
    default unless `--compression-rate` says otherwise, and `--init` does not take it."""
    configs = frontier.configurations([64], ["bound"], ["first"], [64], ["bound"])
    assert {c["fields"]["compression_rate"] for c in configs[1:]} == {HTreeConfig().compression_rate}
    assert configs[2]["fields"]["selection_block"] == HTreeConfig().compression_rate
    assert [c["name"] for c in configs] == ["dense", "htree bound top_k=64", "block first bound top_k=64"]
    assert "compression_rate" not in load_example().SHAPE_FLAGS


def test_extension_continues_a_short_dense_checkpoint_at_a_longer_length(tmp_path):
    """`benchmarks/extension.py` on the CPU: a dense checkpoint trained at 32 tokens
    continued at 64 for 2 steps with dense attention, block selection and per-query
    selection (reference backend), each scored at 64 and 256 and timed; the rows against
    the dense extension, its held-out curve, the batch's tokens kept."""
    example = load_example()
    corpus = tmp_path / "corpus"
    write_corpus(corpus, example)
    example.main(["--data", str(corpus), "--attention", "dense", "--seq-len", "32", "--steps", "2", "--batch", "4",
                  "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--eval-size", "2",
                  "--no-progress", "--save", str(tmp_path / "ck")])
    out = tmp_path / "extension.json"
    rows = extension.main(["--checkpoint", str(tmp_path / "ck"), "--seq-len", "64", "--steps", "2",
                           "--variants", "dense,block:2,query:2,indexer:2", "--compression-rate", "4", "--eval-every", "1",
                           "--index-warmup", "2",
                           "--eval-windows", "1", "--eval-lens", "64,256", "--backend", "reference", "--out", str(out)])
    assert [(r["variant"], r["T"]) for r in rows] == [(v, T) for v in ("dense", "block top_k=2", "per-query top_k=2",
                                                                       "indexer top_k=2 (warm-up 2)")
                                                     for T in (64, 256)]
    assert json.loads(out.read_text()) == json.loads(json.dumps(rows, default=float))
    for r in rows:
        assert np.isfinite(r["bits"]) and r["step_ms"] > 0 and [s for s, _ in r["curve"]] == [1, 2]
        assert r["change"] == pytest.approx(100 * (r["bits"] / r["dense_bits"] - 1))
        assert r["speedup"] == pytest.approx(r["dense_step_ms"] / r["step_ms"])
    assert rows[2]["bits"] != rows[4]["bits"]  # block and per-query selection are two models
    assert rows[6]["bits"] != rows[2]["bits"]  # the indexer (SPEC 13) ranks otherwise
    args = extension.extension_args(extension.parse_args(["--checkpoint", str(tmp_path / "ck"), "--seq-len", "64",
                                                          "--steps", "1"]), extension.parse_variant("block:8"),
                                    {"batch": 4, "seq_len": 32})
    assert (args.batch, args.selection_block, args.block_source, args.top_k) == (2, extension.frontier.DEFAULT_RATE,
                                                                                 "first", 8)
    assert args.selection == "bound"
    indexed = extension.extension_args(extension.parse_args(["--checkpoint", str(tmp_path / "ck"), "--seq-len", "64",
                                                             "--steps", "1"]), extension.parse_variant("indexer:8"),
                                       {"batch": 4, "seq_len": 32})
    assert (indexed.selection, indexed.selection_block, indexed.top_k) == ("indexer", extension.frontier.DEFAULT_RATE, 8)
    table = extension.table(rows)
    assert "| dense |" in table and "| block top_k=2 |" in table and "x) |" in table
    with pytest.raises(SystemExit):
        extension.parse_args(["--checkpoint", "x", "--seq-len", "64", "--steps", "1", "--variants", "block:two"])
    with pytest.raises(ValueError, match=r"^--checkpoint '.*missing': no .* there"):  # its own flag, not --init
        extension.main(["--checkpoint", str(tmp_path / "missing"), "--seq-len", "64", "--steps", "1"])


def test_a_seed_runs_end_to_end_resumes_by_stage_and_travels_in_pieces(tmp_path, capsys):
    """`benchmarks/extension_seed.py` on the CPU (a small model in the recipe's place): the
    dense base, each variant's extension scored against dense, the rows and the table;
    run again it trains only what has no result; the base as bfloat16 pieces of at most
    the piece size rebuilds the same parameters rounded to bfloat16."""
    example = load_example()
    corpus = tmp_path / "corpus"
    write_corpus(corpus, example)
    run, pieces = tmp_path / "seed0", tmp_path / "out"
    argv = ["--dir", str(run), "--data", str(corpus), "--base-len", "32", "--base-steps", "2", "--base-batch", "4",
            "--base-args=--d-model 32 --layers 1 --heads 2 --kv-heads 1 --eval-size 2", "--seq-len", "64",
            "--steps", "2", "--variants", "dense,block:2", "--eval-lens", "64", "--eval-windows", "1",
            "--backend", "reference", "--progress-every", "1", "--pieces", str(pieces)]
    rows = extension_seed.main(argv)
    out = capsys.readouterr().out
    assert [(r["variant"], r["T"]) for r in rows] == [("dense", 64), ("block top_k=2", 64)]
    assert json.loads((run / "rows.json").read_text()) == json.loads(json.dumps(rows, default=float))
    assert "[base] step 2/2" in out and "[block top_k=2] step 1/2" in out and "s left" in out
    assert rows[1]["change"] == pytest.approx(100 * (rows[1]["bits"] / rows[0]["bits"] - 1))
    assert "extension s (dense / this)" in extension_seed.table(rows) and "x) |" in extension_seed.table(rows)
    # Again, one result gone: the base and the dense extension are read back, block runs.
    extension_seed.result_path(run, extension.parse_variant("block:2")).unlink()
    again = extension_seed.main([a for a in argv if a != "--pieces" and a != str(pieces)])
    out = capsys.readouterr().out
    assert "[base] found" in out and "[dense] found" in out and "[block top_k=2] step 2/2" in out
    assert again[0] == rows[0] and again[1]["variant"] == "block top_k=2"
    # The pieces: each within the size, the same parameters rounded to bfloat16.
    files = extension_seed.write_pieces(run / "base", tmp_path / "small", piece_bytes=4096)
    assert len(files) > 3 and all(f.stat().st_size <= 4096 for f in files[:-1])
    extension_seed.read_pieces(tmp_path / "small", tmp_path / "rebuilt")
    original = dict(extension_seed.flat_params(example.read_params(run / "base")))
    rebuilt = dict(extension_seed.flat_params(example.read_params(tmp_path / "rebuilt")))
    assert original.keys() == rebuilt.keys() and (pieces / extension_seed.INDEX).is_file()
    for path, value in original.items():
        np.testing.assert_array_equal(rebuilt[path], np.asarray(value, jnp.bfloat16).astype(np.float32))
    assert example.checkpoint_flags(tmp_path / "rebuilt") == example.checkpoint_flags(run / "base")
    args = frontier.checkpoint_args(str(tmp_path / "rebuilt"), str(corpus), "reference")
    model = example.build_model(args)
    example.load_params(model, tmp_path / "rebuilt")  # a model takes the rebuilt checkpoint
    np.testing.assert_array_equal(np.asarray(model.head.kernel[...]), rebuilt[("head", "kernel")])
