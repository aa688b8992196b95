"""How often does decoding through a model differ from the same model on the whole
sequence, and why? (issue 69, item 4.)

    python benchmarks/decode_agreement.py [--init DIR] [--seq-len 2048] [--prompt 2000] \\
        [--top-ks 16,32,64] [--rules bound,mean] [--out decode_agreement.json]

The byte LM of `examples/train_tiny_lm.py` (no token shift: its decode keeps no previous
position), trained here on the text task with dense attention (`--steps`; its weights then
run with htree, as a converted model does, and training dense is fast on a CPU) or loaded (`--init DIR`, a model
`--save` wrote), run on held-out windows of `--seq-len` bytes three ways: the whole
sequence at once; prefill of `--prompt` tokens through the modules' caches
(`HTreeAttention(decode=True)`) then one token a step; and the same with the prompt
prefilled in the whole sequence's shape (right-padded to `--seq-len`, `lengths` = the
prompt), so that the layers around the attention see arrays of the same shape as the
full pass. For each: the positions whose logits differ from the full pass by more than
1e-3, and the cause: each block's attention input compared bit for bit, and the
selections htree makes from the full pass's inputs against those it makes from the
decoded inputs (`htree_attention(..., return_selected=True)` on each, which equals the
cache's walk on identical inputs), counted where they differ. The same weights are
scored with every `--top-ks` and `--rules`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from htree_jax import HTreeConfig, htree_attention
from htree_jax.bench import run_header
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))
import train_tiny_lm  # noqa: E402


def forward(model, tokens, decode: bool, lengths=None):
    """`(logits [B, S, vocab], attention inputs of each block [B, S, d])`: the model on
    `tokens [B, S]`, whole (`decode=False`) or appended to its caches."""
    x = model.embed(tokens)
    inputs = []
    for block in model.blocks:
        h = block.norm1(x)
        inputs.append(h)
        x = x + block.attention(h, decode=decode, lengths=lengths)
        x = x + block.mlp_out(jax.nn.gelu(block.mlp_in(block.norm2(x))))
    return model.head(model.norm(x)), inputs


def decoded(model, tokens, prompt: int, max_len: int, padded: bool):
    """Logits and attention inputs of prefill (`prompt` tokens, in their own shape or
    right-padded to `max_len`) then one token a step."""
    B = tokens.shape[0]
    for block in model.blocks:
        block.attention.init_cache((B, max_len, block.attention.in_features))
    if padded:
        logits, inputs = forward(model, tokens, True, lengths=jnp.full((B,), prompt, jnp.int32))
        logits, inputs = logits[:, :prompt], [h[:, :prompt] for h in inputs]
    else:
        logits, inputs = forward(model, tokens[:, :prompt], True)
    step = nnx.jit(lambda m, t: forward(m, t, True))
    outs, ins = [logits], [inputs]
    for t in range(prompt, tokens.shape[1]):
        lo, h = step(model, tokens[:, t:t + 1])
        outs.append(lo)
        ins.append(h)
    return jnp.concatenate(outs, 1), [jnp.concatenate([x[i] for x in ins], 1) for i in range(len(ins[0]))]


def selections(block, h, config):
    """The selections htree makes for the block's attention on inputs `h [B, S, d]`."""
    att = block.attention
    q, k, v = att.query(h), att.key(h), att.value(h)
    _, selected = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    return [np.asarray(s) for s in selected]


def compare(model, config, tokens, prompt: int, padded: bool) -> dict:
    T = tokens.shape[1]
    full, full_inputs = forward(model, tokens, False)
    got, got_inputs = decoded(model, tokens, prompt, T, padded)
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(full, np.float64)).max(axis=-1)  # [B, T]
    off = diff > 1e-3
    row = dict(positions=int(diff.size), positions_off=int(off.sum()), max_diff=float(diff.max()),
               first_off=[int(np.argmax(r)) if r.any() else None for r in off],
               prompt_off=int(off[:, :prompt].sum()), steps_off=int(off[:, prompt:].sum()), blocks=[])
    flipped_any = np.zeros(off.shape, bool)
    for i, block in enumerate(model.blocks):
        a, b = np.asarray(full_inputs[i]), np.asarray(got_inputs[i])
        sel_full, sel_dec = selections(block, full_inputs[i], config), selections(block, got_inputs[i], config)
        flipped = np.zeros(off.shape, bool)
        for x, y in zip(sel_full, sel_dec):
            flipped |= np.any(x != y, axis=(-1, -2))
        flipped_any |= flipped
        row["blocks"].append(dict(input_bits_differ=int(np.any(a != b, axis=-1).sum()),
                                  input_max_diff=float(np.abs(a - b).max()),
                                  positions_flipped=int(flipped.sum()),
                                  first_flipped=[int(np.argmax(r)) if r.any() else None for r in flipped]))
    # Every position off at or after the first flipped selection, and none before it,
    # means the flips are what moves the logits beyond rounding.
    first_flip = [int(np.argmax(r)) if r.any() else T for r in flipped_any]
    row["off_before_first_flip"] = int(sum(off[b, :first_flip[b]].sum() for b in range(off.shape[0])))
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--init", default=None, help="a model train_tiny_lm --save wrote (no token shift)")
    p.add_argument("--steps", type=int, default=300, help="training steps when no --init")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=2000)
    p.add_argument("--train-top-k", type=int, default=32)
    p.add_argument("--top-ks", default="16,32,64")
    p.add_argument("--rules", default="bound,mean")
    p.add_argument("--windows", type=int, default=2, help="held-out windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not 0 < a.prompt < a.seq_len:
        p.error("--prompt must be in (0, --seq-len)")
    print(run_header("benchmarks/decode_agreement.py", argv), flush=True)
    train_argv = ["--task", "text", "--attention", "dense", "--no-token-shift", "--seq-len", str(a.seq_len), "--batch", "4",
                  "--d-model", str(a.d_model), "--layers", "2", "--heads", "4", "--kv-heads", "2",
                  "--compression-rate", "16", "--top-k", str(a.train_top_k), "--backend", "reference",
                  "--eval-size", "2", "--eval-batch", "1", "--seed", str(a.seed), "--no-progress",
                  "--log-every", str(max(1, a.steps // 5))]
    if a.init:
        args = train_tiny_lm.parse_args(train_argv + ["--init", a.init, "--steps", "0"])
        if args.token_shift:
            p.error("--init: a model with token shift (its decode needs the previous position's input; train "
                    "it with --no-token-shift)")
    else:
        args = train_tiny_lm.parse_args(train_argv + ["--steps", str(a.steps)])
    trained, result = train_tiny_lm.train(args)
    corpus = train_tiny_lm.task_of(args)
    tokens, _ = corpus.eval_batch(np.random.default_rng(a.seed + 7), a.windows, a.seq_len)
    tokens = jnp.asarray(tokens)
    rows = []
    for rule in [x for x in a.rules.split(",") if x]:
        for top_k in [int(x) for x in a.top_ks.split(",") if x]:
            config = HTreeConfig(compression_rate=16, top_k=top_k, selection=rule, rope_base=args.rope_base, selection_block=1)
            for padded in (False, True):
                model = train_tiny_lm.build_model(args, attention="htree", top_k=top_k, selection=rule)
                nnx.update(model, nnx.state(trained, nnx.Param))
                row = dict(rule=rule, top_k=top_k, prefill="padded to the full shape" if padded else "own shape",
                           layers=list(config.layer_sizes(a.seq_len)), trained_bits_per_byte=result["bits_per_byte"],
                           **compare(model, config, tokens, a.prompt, padded))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "blocks"}), flush=True)
                print("   blocks:", json.dumps(row["blocks"]), flush=True)
                if a.out:
                    pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))
    print("| rule | top_k | prefill | positions off > 1e-3 (prompt / steps) | largest | flipped selections (block 0 / 1) "
          "| off before the first flip |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rule']} | {r['top_k']} | {r['prefill']} | {r['positions_off']} of {r['positions']} "
              f"({r['prompt_off']} / {r['steps_off']}) | {r['max_diff']:.2e} | "
              f"{' / '.join(str(b['positions_flipped']) for b in r['blocks'])} | {r['off_before_first_flip']} |")
    return rows


if __name__ == "__main__":
    main()
