"""`examples/train_tiny_lm.py` at a CI size: it trains (the loss falls) with htree
attention, and its dense baseline runs."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import numpy as np
import pytest

from benchmarks import text_quality

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny_lm.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_make_needle_batch_places_one_needle_in_the_first_half():
    example = load_example()
    tokens, answers = example.make_needle_batch(np.random.default_rng(0), 64, 40, 8)
    is_value = (tokens >= example.NUM_FILLERS) & (tokens < example.NUM_FILLERS + 8)
    assert np.all(is_value.sum(axis=1) == 1)
    where = np.argmax(is_value, axis=1)
    assert np.all(where < 20)
    np.testing.assert_array_equal(tokens[np.arange(64), where], example.NUM_FILLERS + answers)
    assert np.all(tokens[:, -1] == example.NUM_FILLERS + 8)


@pytest.mark.parametrize("seq_len,pairs,queries", [(40, 8, 8), (64, 5, 3), (19, 8, 3)])
def test_make_recall_batch_pairs_keys_with_values_and_asks_for_them(seq_len, pairs, queries):
    example = load_example()
    V, NK, F = 16, 32, example.NUM_FILLERS
    tokens, targets = example.make_recall_batch(np.random.default_rng(seq_len), 50, seq_len, V, NK, pairs, queries)
    assert tokens.shape == (50, seq_len) and targets.shape == (50, queries)
    assert tokens.min() >= 0 and tokens.max() < F + V + NK
    for row, target in zip(tokens, targets):
        context, asked = row[:seq_len - queries], row[seq_len - queries:]
        key_at = np.flatnonzero(context >= F + V)
        assert len(key_at) == pairs and len(set(context[key_at])) == pairs     # distinct keys
        assert np.all(key_at % 2 == 0) and np.all(key_at + 1 < seq_len - queries)
        value_of = {int(context[p]): int(context[p + 1]) for p in key_at}
        assert all(F <= v < F + V for v in value_of.values())
        assert np.sum((context >= F) & (context < F + V)) == pairs              # values only after keys
        assert len(set(asked)) == queries and all(int(k) in value_of for k in asked)
        np.testing.assert_array_equal(target, [value_of[int(k)] for k in asked])
    with pytest.raises(ValueError, match="queries <= pairs"):
        example.make_recall_batch(np.random.default_rng(0), 2, 20, V, NK, 9, 4)


def test_length_schedule_doubles_up_to_the_sequence_length():
    example = load_example()
    assert example.length_schedule(4, 64, 256, 0) == [64] * 4
    assert example.length_schedule(10, 1024, 256, 4) == [256, 256, 512, 512] + [1024] * 6
    schedule = example.length_schedule(1000, 16384, 256, 500)
    assert sorted(set(schedule[:500])) == [256, 512, 1024, 2048, 4096, 8192]
    assert schedule[500:] == [16384] * 500 and schedule == sorted(schedule)


@pytest.mark.parametrize("attention", ["htree", "dense"])
def test_training_lowers_the_loss(attention):
    example = load_example()
    result = example.main(["--attention", attention, "--steps", "40", "--seq-len", "64", "--batch", "16",
                           "--d-model", "32", "--eval-size", "64", "--no-progress", "--log-every", "20"])
    losses = result["losses"]
    assert len(losses) == 40 and np.all(np.isfinite(losses))
    # from ~log(vocab) = 4.7 at the start; about log(16) = 2.8 once it names value tokens only
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses
    assert 0.0 <= result["accuracy"] <= 1.0 and result["task"] == "recall" and result["token_shift"]
    assert result["dtype"] == "float32" and result["step_ms"] > 0


def test_dense_warm_up_hands_parameters_and_optimizer_state_to_htree():
    """`--dense-steps`: where htree is exact attention (T <= top_k * r), a run that
    switches from dense to htree mid-way follows the dense run step for step (the
    parameters, the optimizer's moments and its step count carry over)."""
    example = load_example()
    common = ["--steps", "16", "--seq-len", "64", "--batch", "8", "--d-model", "32", "--eval-size", "16",
              "--no-progress", "--compression-rate", "4", "--top-k", "16"]
    dense = example.main(["--attention", "dense", *common])
    switched = example.main(["--dense-steps", "8", *common])
    assert switched["dense_steps"] == 8 and switched["attention"] == "htree"
    np.testing.assert_allclose(switched["losses"], dense["losses"], rtol=1e-4)


def test_needle_task_with_a_length_curriculum_and_bfloat16_lowers_the_loss():
    example = load_example()
    result = example.main(["--task", "needle", "--steps", "30", "--seq-len", "64", "--batch", "8",
                           "--len-warmup-steps", "10", "--len-warmup-start", "16", "--dtype", "bfloat16",
                           "--d-model", "32", "--eval-size", "16", "--no-progress", "--no-token-shift"])
    losses = result["losses"]
    assert len(losses) == 30 and np.all(np.isfinite(losses)) and result["dtype"] == "bfloat16"
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--queries", "9", "--pairs", "8"],
                                  ["--pairs", "70", "--num-keys", "64"], ["--seq-len", "20", "--pairs", "8"],
                                  ["--len-warmup-steps", "300"], ["--dense-steps", "300"], ["--dense-steps", "-1"],
                                  ["--len-warmup-steps", "10", "--len-warmup-start", "48"]])
def test_bad_arguments_are_refused(argv):
    example = load_example()
    with pytest.raises(SystemExit):
        example.main(argv)


def test_generate_decodes_ragged_prompts_as_the_full_model_would():
    spec = importlib.util.spec_from_file_location("generate", SCRIPT.parent / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    result = generate.main(["--prompt-lengths", "3,11,20", "--new-tokens", "6", "--max-len", "64", "--check",
                            "--per-step"])
    assert result["tokens"].shape == (3, 6)
    assert result["max_abs_diff"] < 1e-4
    # the compiled loop and one call per token give the same tokens
    assert result["per_step_same_tokens"]


def test_train_quality_runs_the_grid_and_writes_what_it_draws(tmp_path):
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks import train_quality

    assert train_quality.run_specs([4096, 16384, 32768], [64], [512]) == [
        (4096, "htree", 64), (4096, "dense", None), (16384, "htree", 64), (16384, "htree", 512),
        (16384, "dense", None), (32768, "htree", 64), (32768, "htree", 512), (32768, "dense", None)]
    # exact attention (T <= top_k * compression_rate) is not run as htree
    assert train_quality.run_specs([1024], [64], [], dense=False) == []
    out = tmp_path / "runs.json"
    results = train_quality.main(["--seq-lens", "64", "--top-k", "4", "--top-k-long", "", "--compression-rate", "4",
                                  "--steps", "4", "--len-warmup-steps", "2", "--tokens-per-step", "256",
                                  "--eval-size", "4", "--out", str(out), "--d-model", "32", "--len-warmup-start", "32"])
    assert [(r["attention"], r["seq_len"], r["batch"], r["steps"]) for r in results] == [
        ("htree", 64, 4, 4), ("dense", 64, 4, 4)]
    import json

    assert json.loads(out.read_text()) == results
    assert "| 64 | htree top_k=4 | 0 | 4 |" in train_quality.table(results)
    assert train_quality.label(dict(results[0], selection="mean")) == "htree top_k=4 mean"
    assert train_quality.label({"attention": "htree", "top_k": 4}) == "htree top_k=4 mean"  # runs before 2026-11-26


def test_train_quality_refuses_tokens_per_step_that_no_batch_fits():
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks import train_quality

    with pytest.raises(SystemExit):
        train_quality.main(["--seq-lens", "4096,32768", "--tokens-per-step", "16384"])


def test_dense_weights_evaluate_as_htree_and_exact_htree_equals_dense():
    """`build_model` + `nnx.update`: a dense model's weights load into the htree model
    (no biases on either), and where htree is exact attention (T <= top_k * r) both
    rules give the dense model's loss; `eval_accuracy` sees the same data every call."""
    from flax import nnx

    example = load_example()
    args = example.parse_args(["--seq-len", "64", "--d-model", "32", "--dtype", "float32", "--eval-size", "4",
                               "--compression-rate", "4", "--top-k", "16", "--rope-base", "1e4"])
    dense = example.build_model(args, "dense")
    want = example.eval_accuracy(dense, args, 64)
    assert example.eval_accuracy(dense, args, 64) == want
    for rule in ("mean", "bound"):
        model = example.build_model(args, "htree", selection=rule)
        nnx.update(model, nnx.state(dense, nnx.Param))
        np.testing.assert_allclose(example.eval_accuracy(model, args, 64)[1], want[1], rtol=1e-5)


def test_selection_transfer_trains_dense_and_evaluates_each_rule(tmp_path):
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks import selection_transfer

    out = tmp_path / "transfer.json"
    results = selection_transfer.main(["--train-len", "128", "--eval-lens", "128,256", "--top-k", "2", "--steps", "2",
                                       "--len-warmup-steps", "0", "--tokens-per-step", "256", "--eval-size", "2",
                                       "--eval-tokens", "512", "--out", str(out), "--save-weights",
                                       str(tmp_path / "w.pkl"), "--", "--d-model", "16", "--dtype", "float32"])
    assert [(r["evaluated"], r["eval_len"], r.get("selection")) for r in results] == [
        ("dense", 128, None), ("htree", 128, "mean"), ("htree", 128, "bound"), ("dense", 256, None),
        ("htree", 256, "mean"), ("htree", 256, "bound")]
    import json

    assert json.loads(out.read_text()) == results
    # The saved weights evaluate to the same accuracies without training again.
    again = selection_transfer.main(["--train-len", "128", "--eval-lens", "256", "--top-k", "2", "--eval-size", "2",
                                     "--eval-tokens", "512", "--tokens-per-step", "256", "--out",
                                     str(tmp_path / "again.json"), "--load-weights", str(tmp_path / "w.pkl"), "--",
                                     "--d-model", "16", "--dtype", "float32"])
    assert [r["accuracy"] for r in again] == [results[0]["accuracy"]] + [r["accuracy"] for r in results[3:]]


def write_corpus(root: pathlib.Path, example) -> dict:
    """Two directories of text files (one name per file, in a nested directory too), a
    binary file, a file that is not UTF-8, a `__pycache__` and a hidden directory:
    `{relative path: text}` of the text files."""
    texts = {}
    for directory in ("pkg", "pkg/sub"):
        for i in range(40):
            path = f"{directory}/m{i:02d}.py"
            texts[path] = f"# {path}\nNAME_{i} = {i} * 3\n" * (i % 5 + 1)
    texts["notes.txt"] = "a top-level note: é, ü\n"
    for path, text in texts.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
    (root / "pkg" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "pkg" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for skipped in ("pkg/__pycache__/m00.pyc", ".git/config", "site-packages/x/y.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("skipped\n")
    return texts


def test_text_corpus_documents_split_and_windows(tmp_path):
    """Per directory one document of its text files in sorted order (each ending in a
    newline); binary, non-UTF-8, cache, hidden and site-packages files left out; the
    held-out files those whose path hashes to 0 mod 20, their own documents; windows
    are byte symbols and their next bytes."""
    example = load_example()
    texts = write_corpus(tmp_path, example)
    corpus = example.TextCorpus.load(tmp_path)
    held = sorted(p for p in texts if example.held_out_file(p))
    assert held and len(held) < len(texts)  # this corpus has files in both splits
    assert corpus.held_out_files == len(held)

    def documents(split_held: bool) -> list[bytes]:
        out = []
        for directory in (".", "pkg", "pkg/sub"):
            names = sorted(p for p in texts if str(pathlib.PurePosixPath(p).parent) == directory
                           and example.held_out_file(p) == split_held)
            if names:
                out.append(b"".join(texts[n].encode() for n in names))
        return out

    assert sorted(bytes(d) for d in corpus.train) == sorted(documents(False))
    assert sorted(bytes(d) for d in corpus.held_out) == sorted(documents(True))
    everything = b"".join(bytes(d) for d in corpus.train + corpus.held_out)
    assert b"skipped" not in everything and b"binary" not in everything and b"caf" not in everything
    rng = np.random.default_rng(0)
    tokens, targets = corpus.batch(rng, 16, 24)
    assert tokens.shape == targets.shape == (16, 24) and tokens.dtype == np.int32
    assert tokens.min() >= 0 and tokens.max() < corpus.vocab == 256
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # the next byte
    train_text = [bytes(d) for d in corpus.train]
    for row, nxt in zip(tokens, targets):  # each window lies inside one training document
        window = bytes(row.astype(np.uint8)) + bytes([nxt[-1]])
        assert any(window in d for d in train_text)
    tokens, _ = corpus.eval_batch(rng, 4, 8)
    assert all(any(bytes(r.astype(np.uint8)) in bytes(d) for d in corpus.held_out) for r in tokens)
    with pytest.raises(ValueError, match="no training document holds"):
        corpus.batch(rng, 2, 10**6)


def test_text_task_trains_two_steps_on_a_directory(tmp_path, capsys):
    example = load_example()
    write_corpus(tmp_path, example)
    result = example.main(["--data", str(tmp_path), "--steps", "2", "--batch", "2", "--seq-len", "32",
                           "--eval-size", "2", "--no-progress", "--d-model", "32", "--layers", "1"])
    assert result["task"] == "text" and result["data"] == str(tmp_path.resolve())
    assert np.isfinite(result["bits_per_byte"]) and result["chance"] == 1 / 256
    out = capsys.readouterr().out
    assert "held out (" in out and "crc32(path) % 20 == 0" in out and "bits per byte held out" in out
    with pytest.raises(SystemExit):
        example.parse_args(["--data", str(tmp_path), "--task", "recall"])


def test_the_default_corpus_is_the_standard_library_source():
    example = load_example()
    root = example.stdlib_source()
    assert (root / "os.py").is_file() and (root / "json" / "__init__.py").is_file()
    assert example.parse_args(["--task", "text"]).data is None  # read from `stdlib_source()`


def test_text_quality_trains_evaluates_and_buckets(tmp_path):
    """`benchmarks/text_quality.py` at a CI size: each trained model's weights scored with
    dense attention and each htree rule on the same held-out windows; bits per byte per
    position bucket."""
    losses = np.full((2, 5000), math.log(2))
    losses[:, :1024] *= 2
    bits = text_quality.bits_per_byte(losses)
    assert bits["0-1K"] == pytest.approx(2.0) and bits["1K-4K"] == pytest.approx(1.0)
    assert bits["4K-16K"] == pytest.approx(1.0) and "16K-64K" not in bits
    assert bits["overall"] == pytest.approx((1024 * 2 + (5000 - 1024)) / 5000)
    corpus_dir = tmp_path / "corpus"
    write_corpus(corpus_dir, load_example())
    out = tmp_path / "tq.json"
    rows = text_quality.main(["--data", str(corpus_dir), "--seq-len", "32", "--steps", "2", "--batch", "2",
                              "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                              "--eval-lens", "32,96", "--eval-windows", "2", "--top-ks", "2", "--train", "dense,htree",
                              "--train-top-k", "2", "--no-progress", "--out", str(out), "--png",
                              str(tmp_path / "tq.png")])
    assert [(r["trained"], r["evaluated"], r["T"]) for r in rows[:6]] == [
        ("dense", "dense", 32), ("dense", "dense", 96), ("dense", "htree bound top_k=2", 32),
        ("dense", "htree bound top_k=2", 96), ("dense", "htree mean top_k=2", 32), ("dense", "htree mean top_k=2", 96)]
    assert len(rows) == 12 and all(np.isfinite(r["bits"]["overall"]) for r in rows)
    assert (tmp_path / "tq.png").stat().st_size > 0 and len(json.loads(out.read_text())) == 12
    assert rows[0]["model"] == dict(d_model=32, layers=1, heads=2, kv_heads=1, lr=2e-3, batch=2, seed=0, train_top_k=2,
                                    eval_windows=2)
    assert "| dense (d32 L1) | htree mean top_k=2 | 96 |" in text_quality.table(rows)


def test_save_then_init_gives_the_same_model(tmp_path):
    """`--save DIR` then `--init DIR --steps 0`: the loaded model gives the saved one's
    held-out loss exactly (same windows), its shape taken from the checkpoint (the
    flags given here say otherwise); `--init` then trains on from it with htree."""
    example = load_example()
    corpus = tmp_path / "corpus"
    write_corpus(corpus, example)
    common = ["--data", str(corpus), "--batch", "2", "--seq-len", "32", "--eval-size", "4", "--no-progress",
              "--backend", "reference", "--compression-rate", "4", "--top-k", "2"]
    saved = example.main([*common, "--attention", "dense", "--steps", "3", "--d-model", "32", "--layers", "1",
                          "--save", str(tmp_path / "ck")])
    loaded = example.main([*common, "--attention", "dense", "--steps", "0", "--d-model", "64", "--layers", "3",
                           "--init", str(tmp_path / "ck")])
    assert loaded["d_model"] == 32 and loaded["layers"] == 1 and loaded["init"] == str(tmp_path / "ck")
    assert loaded["eval_loss"] == saved["eval_loss"]
    adapted = example.main([*common, "--attention", "htree", "--steps", "2", "--grad-clip", "1.0",
                            "--init", str(tmp_path / "ck")])
    assert adapted["grad_clip"] == 1.0
    assert np.isfinite(adapted["eval_loss"]) and adapted["eval_loss"] != saved["eval_loss"]
    with pytest.raises(ValueError, match=r"^--init .*: no model.json there \(a directory written by train_tiny_lm.py "
                                         r"--save\)"):
        example.main([*common, "--steps", "0", "--init", str(tmp_path)])
    with pytest.raises(SystemExit):
        example.parse_args([*common, "--steps", "0"])  # --steps 0 needs --init
