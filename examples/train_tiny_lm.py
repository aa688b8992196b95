"""Train a tiny decoder-only LM with htree attention on a long-range retrieval task, or
on real text.

Three tasks (`--task`); the first two are scored at the last positions of each sequence
only:

- `recall` (default), multi-query associative recall: `--pairs` key-value pairs (a key
  token followed by a value token; distinct keys) at random places among random filler
  tokens, and the sequence ends with `--queries` of those keys, each a query: the model
  must name the value paired with the key at each of the last `--queries` positions.
  Accuracy is over all queries; chance is `1 / num_values`. It takes two hops (a value
  learns which key precedes it, then each query finds the value that follows its key),
  anywhere in the sequence.
- `needle`: one value token somewhere in the first half of the filler, a QUERY token at
  the end; the model names the value there.
- `text` (the default with `--data DIR`): a byte-level language model (256 symbols, no
  tokenizer) of the text files under `DIR`, scored at every position (next-byte loss;
  the output gives it in bits per byte). A document is the text files of one directory
  concatenated in sorted order, so a later file uses the names an earlier one defined;
  a batch is random windows of `--seq-len + 1` bytes of the training documents. The
  held-out split is by path: the files whose `crc32(path under DIR) % 20 == 0`, each
  directory's such files a held-out document of their own (`TextCorpus`). Without
  `--data` it reads a corpus every machine has and nobody here wrote: the source of
  Python's standard library (`sysconfig.get_paths()["stdlib"]`, `site-packages` left out).

With the CPU defaults (T=128, compression_rate=4, top_k=4) the tree has three layers
(128 -> 32 -> 8): each query scores at most 16 candidates per layer (48 in all, of 128
tokens), so most of the past is reachable only through the tree.

    python examples/train_tiny_lm.py                      # htree attention
    python examples/train_tiny_lm.py --attention dense    # dense causal attention baseline
    python examples/train_tiny_lm.py --task text          # bytes of Python's standard library
    python examples/train_tiny_lm.py --data ~/notes --seq-len 1024   # bytes of any directory
    python examples/train_tiny_lm.py --seq-len 16384 --compression-rate 16 --top-k 512 \\
        --d-model 128 --steps 1000 --batch 8 --len-warmup-steps 500 --rope-base 1e6   # on a GPU

At long context, train with a length curriculum (`--len-warmup-steps`) and a long-context
RoPE base (`--rope-base 1e6`): without the first neither attention learns the task at 16K
tokens, without the second neither keeps it past 4K (benchmarks/RESULTS.md, 2026-11-24;
`benchmarks/train_quality.py` runs this comparison).

Both models are the same (RMSNorm, attention with a token shift on its input, MLP blocks,
no positional embedding: RoPE is inside the attention; the dense baseline applies RoPE at
absolute positions, which is what htree computes when T <= top_k * compression_rate).
Parameters are float32, the computation runs in `--dtype` (bfloat16 by default on a GPU,
as long-context training is run; float32 on a CPU). The dense baseline is
`jax.nn.dot_product_attention`, through cuDNN's flash attention on a GPU in bfloat16 (no
`T x T` array), XLA elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import statistics
import sysconfig
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx, serialization

import htree_jax
from htree_jax.core.rope import rope_absolute
from htree_jax.cli import DefaultsHelpFormatter

NUM_FILLERS = 32


@dataclasses.dataclass(frozen=True)
class Task:
    """Token layout: fillers `[0, 32)`, values `[32, 32 + num_values)`, then keys (recall)
    or one QUERY token (needle). Every batch scores its last positions: `queries` of them
    (recall) or one (needle)."""

    name: str
    num_values: int
    num_keys: int = 0
    pairs: int = 0
    queries: int = 1

    @property
    def vocab(self) -> int:
        return NUM_FILLERS + self.num_values + (self.num_keys if self.name == "recall" else 1)

    def eval_batch(self, rng: np.random.Generator, batch: int, seq_len: int):
        """Evaluation draws from the same distribution (fresh sequences)."""
        return self.batch(rng, batch, seq_len)

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int):
        """`tokens [B, T]` int32 and the value tokens to name `targets [B, Q]` at positions
        `[T - Q, T)`, `Q = queries` (recall) or 1 (needle)."""
        if self.name == "needle":
            tokens, answers = make_needle_batch(rng, batch, seq_len, self.num_values)
            return tokens, NUM_FILLERS + answers[:, None]
        return make_recall_batch(rng, batch, seq_len, self.num_values, self.num_keys, self.pairs, self.queries)


# One file in this many is held out, chosen by a hash of its path (`held_out_file`).
HELD_OUT_EVERY = 20


def stdlib_source() -> pathlib.Path:
    """The default corpus: the Python standard library's source directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def held_out_file(relative_path: str) -> bool:
    """The split, by path alone: fixed across runs, machines and corpus orderings."""
    return zlib.crc32(relative_path.encode()) % HELD_OUT_EVERY == 0


def read_text_files(root: pathlib.Path) -> dict:
    """`{directory under root: [(file name, bytes)] in sorted order}`: every regular file
    under `root` that decodes as UTF-8 and holds no NUL byte; `site-packages`,
    `__pycache__` and hidden directories left out."""
    out = {}
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if any(p in ("site-packages", "__pycache__") or p.startswith(".") for p in parts[:-1]):
            continue
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if not data or b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.setdefault(str(path.parent.relative_to(root)), []).append((path.name, data))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class TextCorpus:
    """Byte documents of a directory's text files (see the module docstring): `train` and
    `held_out`, each a tuple of uint8 arrays, one per directory (its files in sorted
    order, each ending in a newline)."""

    root: str
    train: tuple
    held_out: tuple
    held_out_files: int

    vocab = 256

    @staticmethod
    def load(root: pathlib.Path) -> "TextCorpus":
        root = pathlib.Path(root).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"--data must be a directory, got {str(root)!r}")
        train, held_out, held_files = [], [], 0
        for directory, files in read_text_files(root).items():
            parts = {True: [], False: []}
            for name, data in files:
                parts[held_out_file(str(pathlib.PurePosixPath(directory, name)))].append(data.rstrip(b"\n") + b"\n")
            held_files += len(parts[True])
            for split, chunks in ((held_out, parts[True]), (train, parts[False])):
                if chunks:
                    split.append(np.frombuffer(b"".join(chunks), np.uint8))
        if not train or not held_out:
            raise ValueError(f"--data {str(root)!r}: needs text files in both splits (one file in {HELD_OUT_EVERY} "
                             f"is held out, by a hash of its path); found {len(train)} training and {len(held_out)} "
                             "held-out documents")
        return TextCorpus(str(root), tuple(train), tuple(held_out), held_files)

    def describe(self) -> str:
        size = lambda docs: f"{len(docs)} documents, {sum(len(d) for d in docs):,} bytes, longest {max(map(len, docs)):,}"
        return (f"corpus {self.root}: train {size(self.train)}; held out ({self.held_out_files} files whose "
                f"crc32(path) % {HELD_OUT_EVERY} == 0) {size(self.held_out)}")

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int):
        """`tokens [B, T]` and `targets [B, T]` (the next bytes) int32: random windows of
        `T + 1` bytes of the training documents, a document drawn in proportion to the
        windows it holds."""
        return windows(rng, self.train, batch, seq_len, "training")

    def eval_batch(self, rng: np.random.Generator, batch: int, seq_len: int):
        """The same, of the held-out documents."""
        return windows(rng, self.held_out, batch, seq_len, "held-out")


@functools.lru_cache(maxsize=4)
def load_corpus(root: str) -> TextCorpus:
    return TextCorpus.load(pathlib.Path(root))


def windows(rng: np.random.Generator, documents, batch: int, seq_len: int, split: str):
    """`(tokens, targets)` `[B, T]` int32 from windows of `T + 1` bytes of `documents`."""
    need = seq_len + 1
    starts = np.array([len(d) - need + 1 for d in documents], np.int64)
    if starts.max() < 1:
        raise ValueError(f"--seq-len {seq_len}: no {split} document holds {need} bytes (the longest holds "
                         f"{max(map(len, documents))})")
    counts = np.maximum(starts, 0)
    which = rng.choice(len(documents), size=batch, p=counts / counts.sum())
    offsets = (rng.random(batch) * counts[which]).astype(np.int64)
    rows = np.stack([documents[d][o:o + need] for d, o in zip(which, offsets)]).astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


def make_needle_batch(rng: np.random.Generator, batch: int, seq_len: int, num_values: int):
    """`tokens [B, T]` int32 and `answers [B]`: fillers `[0, 32)`, values `[32, 32 + V)`,
    QUERY = `32 + V` at position `T - 1`; one value at a random position in `[0, T/2)`."""
    tokens = rng.integers(0, NUM_FILLERS, (batch, seq_len), dtype=np.int32)
    answers = rng.integers(0, num_values, batch, dtype=np.int32)
    where = rng.integers(0, seq_len // 2, batch)
    tokens[np.arange(batch), where] = NUM_FILLERS + answers
    tokens[:, -1] = NUM_FILLERS + num_values
    return tokens, answers


def make_recall_batch(rng: np.random.Generator, batch: int, seq_len: int, num_values: int, num_keys: int,
                      pairs: int, queries: int):
    """Multi-query associative recall. `tokens [B, T]` int32, `targets [B, queries]` int32.

    Row `b`: filler tokens `[0, 32)`; `pairs` distinct keys `[32 + V, 32 + V + num_keys)`,
    each at an even position `p < T - queries` with its value `[32, 32 + V)` at `p + 1`
    (no two pairs overlap); the last `queries` positions hold distinct keys among those,
    in random order, and `targets[b, j]` is the value paired with the key at
    `T - queries + j`."""
    slots = (seq_len - queries) // 2
    if pairs > slots or queries > pairs or pairs > num_keys:
        raise ValueError(f"recall needs queries <= pairs <= min(num_keys, (seq_len - queries) // 2); got "
                         f"queries={queries}, pairs={pairs}, num_keys={num_keys}, seq_len={seq_len}")
    tokens = rng.integers(0, NUM_FILLERS, (batch, seq_len), dtype=np.int32)
    rows = np.arange(batch)[:, None]
    keys = np.argsort(rng.random((batch, num_keys)), axis=1)[:, :pairs]          # distinct per row
    values = rng.integers(0, num_values, (batch, pairs))
    where = 2 * np.argsort(rng.random((batch, slots)), axis=1)[:, :pairs]       # distinct even positions
    tokens[rows, where] = NUM_FILLERS + num_values + keys
    tokens[rows, where + 1] = NUM_FILLERS + values
    asked = np.argsort(rng.random((batch, pairs)), axis=1)[:, :queries]
    tokens[:, seq_len - queries:] = NUM_FILLERS + num_values + keys[rows, asked]
    return tokens, (NUM_FILLERS + values[rows, asked]).astype(np.int32)


class DenseAttention(nnx.Module):
    """The baseline: the same projections as `HTreeAttention`, RoPE at absolute positions,
    `jax.nn.dot_product_attention(is_causal=True)` (`implementation`: None, "xla" or "cudnn")."""

    def __init__(self, num_heads, in_features, *, num_kv_heads, rope_base, dtype, implementation, rngs, scale=None):
        head_dim = in_features // num_heads
        linear = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.query = nnx.LinearGeneral(in_features, (num_heads, head_dim), **linear)
        self.key = nnx.LinearGeneral(in_features, (num_kv_heads, head_dim), **linear)
        self.value = nnx.LinearGeneral(in_features, (num_kv_heads, head_dim), **linear)
        self.out = nnx.LinearGeneral((num_heads, head_dim), in_features, axis=(-2, -1), **linear)
        self.rope_base = rope_base
        self.implementation = implementation
        self.scale = scale

    def __call__(self, x):
        v = self.value(x)
        q = rope_absolute(self.query(x), self.rope_base).astype(v.dtype)
        k = rope_absolute(self.key(x), self.rope_base).astype(v.dtype)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                    implementation=self.implementation))


def previous_position(x):
    """`x [B, T, D]` shifted one position later along T (zeros at position 0)."""
    return jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]


class Block(nnx.Module):
    """RMSNorm, attention, RMSNorm, MLP, each with a residual. With `token_shift`, the
    attention's input at `t` is `h[t] + W h[t-1]` (`h` the normed stream): the "smeared
    keys" of Olsson et al. (2022), RWKV's token shift. It lets one attention layer bind a
    value to the key just before it; without it, two layers must first grow an induction
    head, which takes this model thousands of steps on the recall task."""

    def __init__(self, d_model, num_heads, num_kv_heads, attention, config, backend, rngs, dtype=None,
                 dense_implementation=None, token_shift=False, indexer=None):
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.shift = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs) if token_shift else None
        if attention == "htree":
            # No biases, as `DenseAttention`: the two take each other's weights (`nnx.update`).
            self.attention = htree_jax.HTreeAttention(num_heads, d_model, num_kv_heads=num_kv_heads,
                                                      config=config, backend=backend, dtype=dtype, use_bias=False,
                                                      indexer=indexer, rngs=rngs)
        else:
            self.attention = DenseAttention(num_heads, d_model, num_kv_heads=num_kv_heads,
                                            rope_base=config.rope_base, scale=config.scale, dtype=dtype,
                                            implementation=dense_implementation, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        h = self.norm1(x)
        if self.shift is not None:
            h = h + self.shift(previous_position(h))
        x = x + self.attention(h)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class TinyLM(nnx.Module):
    """Embedding, `num_layers` blocks, RMSNorm, unembedding. Parameters float32, computation
    in `dtype` (None: float32); `token_shift`: see `Block`; `indexer`: each htree layer's
    `htree_jax.IndexerConfig` with `config.selection="indexer"` (SPEC 13)."""

    def __init__(self, vocab, d_model, num_layers, num_heads, num_kv_heads, attention, config, backend, rngs,
                 dtype=None, dense_implementation=None, token_shift=False, indexer=None):
        self.embed = nnx.Embed(vocab, d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, num_heads, num_kv_heads, attention, config, backend, rngs, dtype,
                                      dense_implementation, token_shift, indexer) for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        """`tokens [B, T]` -> logits `[B, T, vocab]`."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def query_loss(model, tokens, targets):
    """Cross-entropy (float32) of `targets [B, Q]` at the last `Q` positions (text: `Q =
    T`, every position), and the accuracy over all of them."""
    logits = model(tokens)[:, -targets.shape[1]:].astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == targets)


def index_loss_of(model):
    """The sum over the model's htree layers of SPEC 13's loss in their last call
    (`htree_jax.IndexLoss`; 0 without an indexer)."""
    return sum(jax.tree.leaves(nnx.state(model, htree_jax.IndexLoss)), jnp.zeros((), jnp.float32))


INDEX_PARAMS = nnx.All(nnx.Param, nnx.Any(*(nnx.PathContains(name)
                                            for name in ("index_query", "index_key", "index_weight"))))


def warm_up_indexer(model, task, args) -> None:
    """`args.index_warmup_steps` steps of the indexer alone (SPEC 13's loss, Adam at
    `args.lr`, the batches of a seed of their own): the model's other parameters are
    held, so its selections start from a trained indexer, as DeepSeek's indexer is
    warmed up before its sparse training."""
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=INDEX_PARAMS)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss(model):
            model(tokens)
            return index_loss_of(model)

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, INDEX_PARAMS))(model)
        optimizer.update(model, grads)
        return value

    rng = np.random.default_rng(args.seed + 1_000_003)
    for i in range(args.index_warmup_steps):
        tokens, _ = task.batch(rng, args.batch, args.seq_len)
        value = float(step(model, optimizer, jnp.asarray(tokens)))
        if (i + 1) % args.log_every == 0 or i + 1 == args.index_warmup_steps:
            print(f"index warm-up {i + 1:5d}  index loss {value:.4f}", flush=True)


def training_loss(model, tokens, targets, index_weight: float = 1.0):
    """What a step minimises: `query_loss`, plus `index_weight` times the indexer's loss
    (`index_loss_of`: it trains the indexer alone, whose inputs are detached). Aux:
    `(loss, accuracy, index loss)`."""
    loss, acc = query_loss(model, tokens, targets)
    index = index_loss_of(model)
    return loss + index_weight * index, (loss, acc, index)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's shape and htree config (shared with `generate.py`)."""
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--compression-rate", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--selection", choices=("mean", "bound", "indexer"), default="bound",
                   help="htree's ranking of nodes for refinement (HTreeConfig.selection; indexer: SPEC 13's learned "
                        "indexer, trained by its loss beside the model's, on backend reference)")
    p.add_argument("--indexer-heads", type=int, default=4, help="with --selection indexer: IndexerConfig.heads")
    p.add_argument("--indexer-dim", type=int, default=32, help="with --selection indexer: IndexerConfig.head_dim")
    p.add_argument("--index-warmup-steps", type=int, default=0,
                   help="with --selection indexer: steps before --steps that train the indexer alone (the "
                        "model's other parameters held, its loss not followed), as DeepSeek warms its indexer up")
    p.add_argument("--selection-block", type=int, default=None,
                   help="HTreeConfig.selection_block: the compression rate selects by block (SPEC 12), 1 per query; "
                        "default: the library's (by block)")
    p.add_argument("--block-source", choices=("first", "previous"), default="first",
                   help="block selection's ranking rows (HTreeConfig.block_source)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=("htree", "dense"), default="htree")
    p.add_argument("--task", choices=("recall", "needle", "text"), default=None,
                   help="default: text with --data, else recall")
    p.add_argument("--data", default=None,
                   help="text: the directory whose text files are the corpus (default: Python's standard library)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-values", type=int, default=16)
    p.add_argument("--num-keys", type=int, default=64, help="recall: the key vocabulary")
    p.add_argument("--pairs", type=int, default=8, help="recall: key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=8, help="recall: queries at the end (<= pairs)")
    add_model_arguments(p)
    p.add_argument("--token-shift", action=argparse.BooleanOptionalAction, default=True,
                   help="attention input also sees the previous position (see Block)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="computation dtype (parameters stay float32); auto: bfloat16 on a GPU, else float32")
    p.add_argument("--dense-implementation", choices=("auto", "cudnn", "xla"), default="auto",
                   help="the dense baseline's jax.nn.dot_product_attention implementation (auto: cuDNN on a GPU in "
                        "16-bit, else XLA)")
    p.add_argument("--scale", type=float, default=None,
                   help="attention score scale, both attentions (default: head_dim ** -0.5)")
    p.add_argument("--len-warmup-steps", type=int, default=0,
                   help="length curriculum: the first N steps run shorter sequences (see length_schedule)")
    p.add_argument("--len-warmup-start", type=int, default=256, help="the curriculum's first length")
    p.add_argument("--dense-steps", type=int, default=0,
                   help="htree: the first N steps train the same parameters with dense attention, then htree "
                        "(a dense warm-up, as DeepSeek's sparse attention is trained)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=None,
                   help="clip the gradients' global norm to this (optax.clip_by_global_norm); none by default")
    p.add_argument("--index-loss-weight", type=float, default=1.0,
                   help="with --selection indexer: the indexer's loss's weight in each step's (it trains the "
                        "indexer alone)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: min(100, steps/10 + 1))")
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--eval-batch", type=int, default=None, help="eval rows per call (default: --batch)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out evaluation every N steps as well as at the end (0: at the end only): the curve "
                        "and its change over the last tenth of the steps (the text task: bits per byte)")
    p.add_argument("--backend", default="auto", help="htree backend: auto, reference, pallas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write the trained model to DIR (its parameters and the flags that shape it)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from the model saved in DIR (its shape flags replace these; --steps 0: only "
                        "evaluate it). The attention, compression_rate, top_k, selection and backend stay this "
                        "run's: a dense checkpoint continues with htree")
    args = p.parse_args(argv)
    if args.init:
        load_shape_flags(args)
    if args.task is None:
        args.task = "text" if args.data else "recall"
    if args.data and args.task != "text":
        p.error(f"--data is the text task's corpus; --task {args.task} makes its own sequences")
    if args.steps < (0 if args.init else 1):
        p.error("--steps must be >= 1 (0 only with --init: evaluate the loaded model)")
    for name in ("batch", "seq_len", "num_values", "num_keys", "pairs", "queries", "d_model", "layers",
                 "heads", "kv_heads", "eval_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0 (0: evaluate at the end only)")
    if args.seq_len < 4:
        p.error("--seq-len must be >= 4")
    if args.dense_steps < 0 or args.dense_steps >= max(args.steps, 1):
        p.error("--dense-steps must be in [0, --steps)")
    if args.selection == "indexer" and (args.dense_steps or args.attention != "htree"):
        p.error("--selection indexer: htree attention from the first step (its indexer learns beside it; a dense "
                "warm-up would leave it untrained)")
    if args.indexer_heads < 1 or args.indexer_dim < 1:
        p.error("--indexer-heads and --indexer-dim must be >= 1")
    if args.index_warmup_steps < 0 or (args.index_warmup_steps and args.selection != "indexer"):
        p.error("--index-warmup-steps: a count >= 0, with --selection indexer")
    if args.len_warmup_steps < 0 or args.len_warmup_steps >= max(args.steps, 1):
        p.error("--len-warmup-steps must be in [0, --steps)")
    shortest = min(args.seq_len, args.len_warmup_start) if args.len_warmup_steps else args.seq_len
    if args.len_warmup_steps and (shortest < 4 or args.seq_len % shortest or args.batch * args.seq_len % shortest):
        p.error("--len-warmup-start must be >= 4 and divide --seq-len and --batch * --seq-len")
    if args.task == "text" and args.len_warmup_steps:
        p.error("--len-warmup-steps: the text task trains at --seq-len (no length curriculum)")
    if args.task == "recall" and not (args.queries <= args.pairs <= min(args.num_keys,
                                                                          (shortest - args.queries) // 2)):
        p.error("--queries <= --pairs <= min(--num-keys, (L - --queries) // 2) for the recall task, L the "
                "shortest sequence (--seq-len, or --len-warmup-start with a length curriculum)")
    return args


def length_schedule(steps: int, seq_len: int, start: int, warmup_steps: int) -> list[int]:
    """The sequence length of each step: over the first `warmup_steps`, `start`, `2 start`,
    ... up to `seq_len / 2`, equal shares of those steps each (a length curriculum, as
    long-context models are trained: from scratch, a query's one relevant token among
    16K gets too little gradient to be found); then `seq_len`."""
    lengths = []
    while warmup_steps and start < seq_len:
        lengths.append(start)
        start *= 2
    if not lengths:
        return [seq_len] * steps
    per = warmup_steps / len(lengths)
    return [lengths[int(step / per)] if step < warmup_steps else seq_len for step in range(steps)]


# The flags that fix a model's parameters: a checkpoint records them, `--init` takes them.
# (`compression_rate`, like `top_k` and `selection`, shapes no parameter: htree's tree is
# this run's choice, a dense checkpoint's training flag for it meant nothing; the run's
# own value is recorded beside the flags, under "trained".)
SHAPE_FLAGS = ("task", "data", "d_model", "layers", "heads", "kv_heads", "token_shift", "num_values", "num_keys",
               "rope_base", "scale")
# The parameters as an orbax-checkpoint `StandardCheckpointer` writes them (measured
# against Flax's msgpack on the frontier's model, 18.4M float32 parameters on this
# project's CPU machine, 2026-12-07: saves 0.31-0.52 s against 0.42-0.64, loads 0.15-0.17
# against 0.04-0.12, 64.7 MB against 70.1; journal). Checkpoints of the msgpack file
# written before it are still read.
CHECKPOINT_PARAMS, CHECKPOINT_FLAGS, MSGPACK_PARAMS = "params", "model.json", "params.msgpack"


def save_model(model, args, directory, result: dict | None = None) -> pathlib.Path:
    """Writes `model`'s parameters (float32, the pure dict of `nnx.state(model,
    nnx.Param)` through orbax-checkpoint: `write_params`) and the flags that shape it to
    `directory`;
    `result`'s scalars (steps, bits per byte, ...) are recorded beside them."""
    directory = pathlib.Path(directory)
    write_params(directory, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    flags = {name: getattr(args, name) for name in SHAPE_FLAGS}
    flags["data"] = str(task_of(args).root) if args.task == "text" else None
    scalars = {k: v for k, v in (result or {}).items() if isinstance(v, (int, float, str, bool)) or v is None}
    (directory / CHECKPOINT_FLAGS).write_text(json.dumps({"flags": flags, "trained": scalars}, indent=1))
    return directory


def checkpoint_flags(directory, flag: str = "--init") -> dict:
    """The `SHAPE_FLAGS` (and what the run recorded) of a model saved by `save_model`;
    a missing one is a ValueError naming `flag`, the option that gave `directory`."""
    path = pathlib.Path(directory) / CHECKPOINT_FLAGS
    if not path.is_file():
        raise ValueError(f"{flag} {str(directory)!r}: no {CHECKPOINT_FLAGS} there (a directory written by "
                         "train_tiny_lm.py --save)")
    return json.loads(path.read_text())


def load_shape_flags(args) -> None:
    """`--init DIR`: the flags that shape the saved model replace `args`' own."""
    saved = checkpoint_flags(args.init)["flags"]
    for name in SHAPE_FLAGS:
        if name == "data" and args.data:  # the same corpus at another path (another machine) is allowed
            continue
        setattr(args, name, saved[name])


def write_params(directory, params: dict) -> None:
    """Writes a model's parameters, the pure dict of `nnx.state(model, nnx.Param)`, to
    `directory/CHECKPOINT_PARAMS` (created; replaced where it is) with orbax-checkpoint."""
    directory = pathlib.Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / CHECKPOINT_PARAMS, params, force=True)


def read_params(directory, like: dict | None = None) -> dict:
    """The pure dict of parameters `write_params` wrote to `directory`, laid out as `like`
    (a pure dict of the model's own: its list entries keep int keys) where given; a
    checkpoint of the earlier msgpack file is read too."""
    directory = pathlib.Path(directory).resolve()
    if (directory / MSGPACK_PARAMS).is_file():
        return serialization.msgpack_restore((directory / MSGPACK_PARAMS).read_bytes())
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(directory / CHECKPOINT_PARAMS, like)


def load_params(model, directory) -> None:
    """Sets `model`'s parameters to those `save_model` wrote to `directory` (the same
    shapes: `load_shape_flags` made the model so). A model with an indexer (SPEC 13)
    continuing a checkpoint without one (a dense base) keeps its own fresh index
    projections: the checkpoint gives every other parameter."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, matched(nnx.to_pure_dict(state), read_params(directory)))
    nnx.update(model, state)


def matched(mine: dict, saved: dict) -> dict:
    """`mine` (a model's pure dict of parameters) with each value `saved` holds (its keys
    as written: a list's entries may come back as strings); an indexer's projections
    (`index_*`) that `saved` lacks keep `mine`'s, and those `saved` has that `mine`
    lacks are left out (a dense model evaluating an indexer's checkpoint)."""
    out = {}
    for key, value in mine.items():
        there = saved[key] if key in saved else saved.get(str(key))
        if there is None:
            if not str(key).startswith("index_"):
                raise KeyError(f"the checkpoint has no parameter {key!r}")
            out[key] = value
        else:
            out[key] = matched(value, there) if isinstance(value, dict) else there
    return out


def compute_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.dtype(name)


def task_of(args):
    """The `Task`, or for `text` the `TextCorpus` (read once per directory)."""
    if args.task == "text":
        return load_corpus(str(args.data or stdlib_source()))
    return Task(args.task, args.num_values, args.num_keys, args.pairs, args.queries)


def chance_of(args) -> float:
    return 1 / (TextCorpus.vocab if args.task == "text" else args.num_values)


def htree_config(args, **config_fields) -> htree_jax.HTreeConfig:
    """The `HTreeConfig` `args` describe, `config_fields` replacing theirs."""
    fields = dict(compression_rate=args.compression_rate, top_k=args.top_k, scale=args.scale,
                  rope_base=args.rope_base, selection=args.selection, selection_block=args.selection_block,
                  block_source=args.block_source)
    return htree_jax.HTreeConfig(**{**fields, **config_fields})


def build_model(args, attention: str | None = None, **config_fields) -> TinyLM:
    """The model `args` describe, with `attention` ("htree" or "dense", default
    `args.attention`) and `config_fields` replacing those of `args` (e.g. `top_k`,
    `selection`). Models that differ only there have the same parameters."""
    config = htree_config(args, **config_fields)
    dtype = compute_dtype(args.dtype)
    attention = attention or args.attention
    indexer = (htree_jax.IndexerConfig(heads=args.indexer_heads, head_dim=args.indexer_dim)
               if attention == "htree" and config.selection == "indexer" else None)
    return TinyLM(task_of(args).vocab, args.d_model, args.layers, args.heads, args.kv_heads,
                  attention, config, args.backend, nnx.Rngs(args.seed), dtype=dtype,
                  dense_implementation=dense_implementation(dtype, args.dense_implementation),
                  token_shift=args.token_shift, indexer=indexer)


def dense_implementation(dtype, choice: str = "auto") -> str:
    """cuDNN's flash attention takes bfloat16/float16 only; XLA's materialises [B, H, T, T].
    `choice` ("cudnn" or "xla") overrides the rule ("auto")."""
    if choice != "auto":
        return choice
    return "cudnn" if jax.default_backend() == "gpu" and dtype != jnp.float32 else "xla"


@nnx.jit
def evaluate(model, tokens, targets):
    return query_loss(model, tokens, targets)


def eval_accuracy(model, args, seq_len: int, eval_size: int | None = None) -> tuple[float, float]:
    """`(accuracy, loss)` over `eval_size` (default `args.eval_size`) fresh sequences of
    `seq_len` tokens (text: windows of the held-out documents; the accuracy the next
    byte's), the same ones for every model with the same `args.seed`."""
    task, eval_size = task_of(args), eval_size or args.eval_size
    eval_rng = np.random.default_rng(args.seed + 10**6)
    eval_batch = args.eval_batch or args.batch
    correct = total_loss = 0.0
    for first in range(0, eval_size, eval_batch):
        rows = min(eval_batch, eval_size - first)
        tokens, targets = task.eval_batch(eval_rng, rows, seq_len)
        loss, acc = evaluate(model, jnp.asarray(tokens), jnp.asarray(targets))
        correct += float(acc) * rows
        total_loss += float(loss) * rows
    return correct / eval_size, total_loss / eval_size


def main(argv=None) -> dict:
    """Trains and evaluates; returns `{"losses": [...], "accuracy": float, "step_ms": float, ...}`."""
    return train(parse_args(argv))[1]


def last_tenth_change(curve: list, steps: int) -> float | None:
    """The held-out loss's relative change (%) over the last tenth of `steps`: from the
    last evaluation at or before `0.9 * steps` to the final one; None without one there
    (`curve`: `[[step, loss], ...]`, ascending, ending at `steps`)."""
    before = [loss for step, loss in curve[:-1] if step <= 0.9 * steps]
    if not before or curve[-1][0] != steps:
        return None
    return 100 * (curve[-1][1] / before[-1] - 1)


def train(args, on_step=None) -> tuple[TinyLM, dict]:
    """Trains the model `args` describe and evaluates it: `(model, result)`.
    `on_step(step, model)`, if given, is called after every step (`step` counted from
    1), e.g. to score the model part way."""
    task = task_of(args)
    dtype = compute_dtype(args.dtype)
    model = build_model(args)
    if args.init:
        load_params(model, args.init)
        print(f"parameters from {args.init} ({checkpoint_flags(args.init)['trained'].get('steps', '?')} steps "
              "trained there)", flush=True)
    config = model.blocks[0].attention.config if args.attention == "htree" else None
    warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10 + 1)
    lr_schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1))
    transform = optax.adamw(lr_schedule, weight_decay=0.01)
    if args.grad_clip is not None:
        transform = optax.chain(optax.clip_by_global_norm(args.grad_clip), transform)
    make_optimizer = lambda model: nnx.Optimizer(model, transform, wrt=nnx.Param)
    optimizer = make_optimizer(model)
    dense_steps = args.dense_steps if args.attention == "htree" else 0
    if dense_steps:  # the same parameters (and optimizer state) under dense attention
        dense_model = build_model(args, attention="dense")
        dense_optimizer = make_optimizer(dense_model)

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        (_, (loss, acc, index)), grads = nnx.value_and_grad(training_loss, has_aux=True)(
            model, tokens, targets, args.index_loss_weight)
        optimizer.update(model, grads)
        return loss, acc, index

    if args.index_warmup_steps:
        warm_up_indexer(model, task, args)

    layers = config.layer_sizes(args.seq_len) if args.attention == "htree" else (args.seq_len,)
    attention = (args.attention if args.attention == "htree"
                 else f"dense ({dense_implementation(dtype, args.dense_implementation)})")
    print(f"task={args.task} attention={attention} T={args.seq_len} tree layers={list(layers)} "
          f"dtype={jnp.dtype(dtype).name} chance={chance_of(args):.3f} platform={jax.default_backend()}",
          flush=True)
    if args.task == "text":
        print(task.describe(), flush=True)
    rng = np.random.default_rng(args.seed)
    steps = range(args.steps)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        steps = bar = tqdm(steps, desc=f"train {args.attention}", mininterval=0.5)
    losses, accuracies, step_seconds, eval_curve, index_losses = [], [], [], [], []
    per_byte = lambda loss: f" ({loss / math.log(2):.4f} bits per byte)" if args.task == "text" else ""
    start = time.perf_counter()
    schedule = length_schedule(args.steps, args.seq_len, args.len_warmup_start, args.len_warmup_steps)
    for step in steps:
        seq_len = schedule[step]
        if step == 0 or seq_len != schedule[step - 1]:
            print(f"step {step + 1:5d}  sequences of {seq_len} tokens, batch {args.batch * args.seq_len // seq_len}",
                  flush=True)
        tokens, targets = task.batch(rng, args.batch * args.seq_len // seq_len, seq_len)
        if dense_steps and step == dense_steps:
            print(f"step {step + 1:5d}  htree from here (dense before)", flush=True)
            nnx.update(model, nnx.state(dense_model, nnx.Param))
            nnx.update(optimizer, nnx.state(dense_optimizer))
        tic = time.perf_counter()
        if step < dense_steps:
            loss, acc, index = train_step(dense_model, dense_optimizer, jnp.asarray(tokens), jnp.asarray(targets))
        else:
            loss, acc, index = train_step(model, optimizer, jnp.asarray(tokens), jnp.asarray(targets))
        losses.append(float(loss))                      # waits for the step
        index_losses.append(float(index))
        step_seconds.append(time.perf_counter() - tic)
        accuracies.append(float(acc))
        if bar is not None:
            tokens_per_s = args.batch * args.seq_len / step_seconds[-1]
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{accuracies[-1]:.2f}", tok_s=f"{tokens_per_s:,.0f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            indexed = f"  index loss {index_losses[-1]:.4f}" if args.selection == "indexer" else ""
            print(f"step {step + 1:5d}  loss {losses[-1]:.4f}  batch acc {accuracies[-1]:.3f}{indexed}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            eval_curve.append([step + 1, eval_accuracy(model, args, args.seq_len)[1]])
            print(f"step {step + 1:5d}  held out: loss {eval_curve[-1][1]:.4f}{per_byte(eval_curve[-1][1])}",
                  flush=True)
        if on_step is not None:
            on_step(step + 1, model)
    train_s = time.perf_counter() - start
    # the step time: the median over the steps at the full length but its first (it
    # compiles), with the model's own attention (after any dense warm-up)
    full = [s for i, (s, n) in enumerate(zip(step_seconds, schedule)) if n == args.seq_len and i >= dense_steps]
    step_ms = 1e3 * statistics.median(full[1:] if len(full) > 1 else full) if full else float("nan")
    accuracy, eval_loss = eval_accuracy(model, args, args.seq_len)
    eval_curve.append([args.steps, eval_loss])  # lists, as JSON gives them back
    result = dict(task=args.task, attention=args.attention, seq_len=args.seq_len,
                  top_k=args.top_k if args.attention == "htree" else None,
                  selection=args.selection if args.attention == "htree" else None,
                  selection_block=htree_config(args).selection_block if args.attention == "htree" else None,
                  compression_rate=args.compression_rate, dtype=jnp.dtype(dtype).name, steps=args.steps,
                  batch=args.batch, d_model=args.d_model, layers=args.layers, heads=args.heads,
                  kv_heads=args.kv_heads, token_shift=args.token_shift, pairs=args.pairs, queries=args.queries,
                  num_values=args.num_values, seed=args.seed, lr=args.lr, grad_clip=args.grad_clip, scale=args.scale,
                  rope_base=args.rope_base, len_warmup_steps=args.len_warmup_steps,
                  dense_implementation=dense_implementation(dtype, args.dense_implementation),
                  len_warmup_start=args.len_warmup_start, dense_steps=dense_steps, losses=losses,
                  index_losses=index_losses if args.selection == "indexer" else None,
                  index_warmup_steps=args.index_warmup_steps,
                  batch_accuracies=accuracies,
                  eval_loss=eval_loss, accuracy=accuracy, chance=chance_of(args), train_seconds=train_s,
                  step_ms=step_ms, tokens_per_second=args.batch * args.seq_len / (step_ms / 1e3),
                  eval_curve=eval_curve, last_tenth_change=last_tenth_change(eval_curve, args.steps),
                  device=jax.devices()[0].device_kind)
    if args.task == "text":
        result.update(data=task.root, bits_per_byte=eval_loss / math.log(2))
    if args.init:
        result.update(init=str(args.init))
    if args.save:
        save_model(model, args, args.save, result)
        print(f"saved to {args.save}", flush=True)
    held = f", {eval_loss / math.log(2):.3f} bits per byte held out" if args.task == "text" else ""
    if result["last_tenth_change"] is not None:
        held += f" ({result['last_tenth_change']:+.2f}% over the last tenth of the steps)"
    print(f"final: task={args.task} attention={attention} T={args.seq_len} eval accuracy {accuracy:.3f} (chance "
          f"{chance_of(args):.3f}), eval loss {eval_loss:.4f}{held}, {train_s:.0f} s, {step_ms:.1f} ms/step, "
          f"{result['tokens_per_second']:,.0f} tokens/s", flush=True)
    return model, result


if __name__ == "__main__":
    main()
