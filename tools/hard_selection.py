"""What htree's hard top-K does to a user's first sanity checks, measured (the README's
"Hard selection" note; figures in benchmarks/RESULTS.md): the same rows at two batch
sizes, the same inputs in bfloat16 and float32, and finite differences of a loss over
all of q against over one coordinate. Any platform (the JAX reference by default).

    python tools/hard_selection.py --seed 1   # T=2048, H=8, H_kv=2, K=64, top_k=16

A row's selection may differ between two runs that round differently in the last bit
where two candidates' importances are that close: a near-tie, which the float64 oracle
flags (`reference_numpy.htree_attention_numpy(..., return_fragile=True)`). Where a
selection differs, the row's output moves by as much as the two nodes' contributions
differ, not by a rounding error; every other row agrees to rounding.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig, htree_attention
from htree_jax.cli import DefaultsHelpFormatter
from reference_numpy import htree_attention_numpy

DESCRIPTION = __doc__.split("\n\n")[0]


def rows_differing(selected_a, selected_b) -> np.ndarray:
    """`[B, T, H_kv]` bool: the rows whose selection differs at some layer."""
    differ = None
    for a, b in zip(selected_a, selected_b):
        d = np.any(np.asarray(a) != np.asarray(b), axis=-1)
        differ = d if differ is None else differ | d
    return differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="reference")
    p.add_argument("--eps", type=float, default=1e-2, help="the finite differences' step")
    args = p.parse_args(argv)
    T, H, H_kv, K = args.T, args.heads, args.kv_heads, args.head_dim
    config = HTreeConfig(top_k=args.top_k, selection_block=1)
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((3, T, h, K)).astype(np.float32) for h in (H, H_kv, H_kv))
    run = lambda q, k, v: htree_attention(q, k, v, config, backend=args.backend, return_selected=True)
    print(f"T={T} H={H} H_kv={H_kv} K={K} top_k={args.top_k} layers={config.layer_sizes(T)} backend={args.backend}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}", flush=True)

    # 1. The first row alone against the same row inside a batch of three.
    o3, s3 = run(q, k, v)
    o1, s1 = run(q[:1], k[:1], v[:1])
    differ = rows_differing([x[:1] for x in s3], s1)
    _, _, fragile = htree_attention_numpy(q[:1], k[:1], v[:1], config, return_selected=True, return_fragile=True)
    gap = float(np.max(np.abs(np.asarray(o3[:1]) - np.asarray(o1))))
    print(f"B=3 against B=1, row 0: largest output difference {gap:.3g}; rows (query, kv head) whose selection "
          f"differs {int(differ.sum())} of {differ.size}, of them flagged near-ties by the oracle "
          f"{int((differ & fragile).sum())}", flush=True)

    # 2. bfloat16 against float32 on the same (bf16-representable) inputs.
    qb, kb, vb = (jnp.asarray(x[:1], jnp.bfloat16) for x in (q, k, v))
    of, sf = run(*(x.astype(jnp.float32) for x in (qb, kb, vb)))
    ob, sb = run(qb, kb, vb)
    differ = rows_differing(sf, sb)
    gap = float(np.max(np.abs(np.asarray(ob, np.float32) - np.asarray(of))))
    same = np.repeat(~differ, H // H_kv, axis=2)
    rounding = float(np.max(np.abs(np.asarray(ob, np.float32) - np.asarray(of))[same]))
    print(f"bfloat16 against float32: largest output difference {gap:.3g} ({rounding:.3g} over the rows whose "
          f"selections agree); rows whose selection differs {int(differ.sum())} of {differ.size}", flush=True)

    # 3. Finite differences of a loss along all of q, and along one coordinate.
    w = rng.standard_normal(o1.shape).astype(np.float32)
    loss = lambda q: jnp.sum(htree_attention(q, k[:1], v[:1], config, backend=args.backend) * w)
    q0 = jnp.asarray(q[:1])
    grad = np.asarray(jax.grad(loss)(q0))
    direction = rng.standard_normal(q0.shape).astype(np.float32)
    direction /= np.linalg.norm(direction)
    one = np.zeros(q0.shape, np.float32)
    one[0, T // 2, 0, 0] = 1.0
    for name, d in (("all of q (a random unit direction)", direction), ("one coordinate of q", one)):
        fd = float((loss(q0 + args.eps * d) - loss(q0 - args.eps * d)) / (2 * args.eps))
        analytic = float(np.sum(grad * d))
        print(f"finite differences along {name}, step {args.eps:g}: {fd:.5g} against the gradient's {analytic:.5g} "
              f"(relative {abs(fd - analytic) / max(abs(analytic), 1e-30):.2g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
