"""Train a tiny decoder-only LM with htree attention on a long-range retrieval task.

The task (needle retrieval): a sequence of `--seq-len` random filler tokens holds one
"value" token (from a separate vocabulary of `--num-values`) somewhere in its first half,
and ends with a QUERY token; the model must name the value at the last position. Chance
is `1 / num_values`. With the defaults (T=128, compression_rate=4, top_k=4) the tree has
three layers (128 -> 32 -> 8), so each query scores at most 16 candidates per layer (48 in
all, of 128 tokens) and the needle, up to 127 tokens back, is reachable only through the
tree.

    python examples/train_tiny_lm.py                      # htree attention
    python examples/train_tiny_lm.py --attention dense    # dense causal attention baseline

Both models are the same (RMSNorm, attention, MLP blocks, no positional embedding: RoPE
is inside the attention; the dense baseline applies RoPE at absolute positions, which is
what htree computes when T <= top_k * compression_rate). Runs on the CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import htree_jax
from htree_jax.rope import rope_absolute

NUM_FILLERS = 32


def make_batch(rng: np.random.Generator, batch: int, seq_len: int, num_values: int):
    """`tokens [B, T]` int32 and `answers [B]`: fillers `[0, 32)`, values `[32, 32 + V)`,
    QUERY = `32 + V` at position `T - 1`; one value at a random position in `[0, T/2)`."""
    tokens = rng.integers(0, NUM_FILLERS, (batch, seq_len), dtype=np.int32)
    answers = rng.integers(0, num_values, batch, dtype=np.int32)
    where = rng.integers(0, seq_len // 2, batch)
    tokens[np.arange(batch), where] = NUM_FILLERS + answers
    tokens[:, -1] = NUM_FILLERS + num_values
    return tokens, answers


class DenseAttention(nnx.Module):
    """The baseline: the same projections as `HTreeAttention`, RoPE at absolute positions,
    `jax.nn.dot_product_attention(is_causal=True)`."""

    def __init__(self, num_heads, in_features, *, num_kv_heads, rope_base, rngs):
        head_dim = in_features // num_heads
        self.query = nnx.LinearGeneral(in_features, (num_heads, head_dim), use_bias=False, rngs=rngs)
        self.key = nnx.LinearGeneral(in_features, (num_kv_heads, head_dim), use_bias=False, rngs=rngs)
        self.value = nnx.LinearGeneral(in_features, (num_kv_heads, head_dim), use_bias=False, rngs=rngs)
        self.out = nnx.LinearGeneral((num_heads, head_dim), in_features, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.rope_base = rope_base

    def __call__(self, x):
        q = rope_absolute(self.query(x), self.rope_base)
        k = rope_absolute(self.key(x), self.rope_base)
        return self.out(jax.nn.dot_product_attention(q, k, self.value(x), is_causal=True))


class Block(nnx.Module):
    def __init__(self, d_model, num_heads, num_kv_heads, attention, config, backend, rngs):
        self.norm1 = nnx.RMSNorm(d_model, rngs=rngs)
        if attention == "htree":
            self.attention = htree_jax.HTreeAttention(num_heads, d_model, num_kv_heads=num_kv_heads,
                                                      config=config, backend=backend, rngs=rngs)
        else:
            self.attention = DenseAttention(num_heads, d_model, num_kv_heads=num_kv_heads,
                                            rope_base=config.rope_base, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class TinyLM(nnx.Module):
    def __init__(self, vocab, d_model, num_layers, num_heads, num_kv_heads, attention, config, backend, rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, num_heads, num_kv_heads, attention, config, backend, rngs)
                                for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens):
        """`tokens [B, T]` -> logits `[B, T, vocab]`."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def last_position_loss(model, tokens, answers, num_values):
    """Cross-entropy of the answer at the last position, and the accuracy there."""
    logits = model(tokens)[:, -1]
    targets = NUM_FILLERS + answers
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == targets)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's shape and htree config (shared with `generate.py`)."""
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--compression-rate", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=("htree", "dense"), default="htree")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-values", type=int, default=16)
    add_model_arguments(p)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--backend", default="auto", help="htree backend: auto, reference, pallas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "num_values", "d_model", "layers", "heads", "kv_heads",
                 "eval_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len < 4:
        p.error("--seq-len must be >= 4")
    return args


def main(argv=None) -> dict:
    """Trains and evaluates; returns `{"losses": [...], "accuracy": float, ...}`."""
    args = parse_args(argv)
    config = htree_jax.HTreeConfig(compression_rate=args.compression_rate, top_k=args.top_k)
    vocab = NUM_FILLERS + args.num_values + 1
    model = TinyLM(vocab, args.d_model, args.layers, args.heads, args.kv_heads, args.attention, config,
                   args.backend, nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10 + 1), args.steps), weight_decay=0.01), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens, answers):
        (loss, acc), grads = nnx.value_and_grad(last_position_loss, has_aux=True)(
            model, tokens, answers, args.num_values)
        optimizer.update(model, grads)
        return loss, acc

    @nnx.jit
    def evaluate(model, tokens, answers):
        return last_position_loss(model, tokens, answers, args.num_values)

    layers = config.layer_sizes(args.seq_len) if args.attention == "htree" else (args.seq_len,)
    print(f"attention={args.attention} T={args.seq_len} tree layers={list(layers)} "
          f"chance={1 / args.num_values:.3f} platform={jax.default_backend()}", flush=True)
    rng = np.random.default_rng(args.seed)
    steps = range(args.steps)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        steps = bar = tqdm(steps, desc=f"train {args.attention}", mininterval=0.5)
    losses, start = [], time.perf_counter()
    for step in steps:
        tokens, answers = make_batch(rng, args.batch, args.seq_len, args.num_values)
        loss, acc = train_step(model, optimizer, jnp.asarray(tokens), jnp.asarray(answers))
        losses.append(float(loss))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{float(acc):.2f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1:5d}  loss {losses[-1]:.4f}  batch acc {float(acc):.3f}", flush=True)
    train_s = time.perf_counter() - start
    tokens, answers = make_batch(np.random.default_rng(args.seed + 10**6), args.eval_size, args.seq_len,
                                 args.num_values)
    eval_loss, accuracy = evaluate(model, jnp.asarray(tokens), jnp.asarray(answers))
    result = dict(attention=args.attention, losses=losses, eval_loss=float(eval_loss), accuracy=float(accuracy),
                  chance=1 / args.num_values, train_seconds=train_s)
    print(f"final: attention={args.attention} eval accuracy {float(accuracy):.3f} (chance "
          f"{1 / args.num_values:.3f}), eval loss {float(eval_loss):.4f}, {train_s:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
