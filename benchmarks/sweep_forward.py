"""Block-size sweep of the Pallas forward on the GPU (one T, one config).

    python benchmarks/sweep_forward.py --T 8192 --top-k 512
"""

from __future__ import annotations

import argparse
import itertools

import jax
from jax import lax

from htree_jax.bench import dense_fn, inputs, median_ms
from htree_jax import HTreeConfig
from pallas_kernels.forward import htree_forward_pallas
from pallas_kernels.plan import BlockSizes
from pallas_kernels.precision import Precisions


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--tiles", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--precisions", default="auto,high,highest",
                   help="auto: the backend's defaults; else every dot at that precision, float32 operands")
    args = p.parse_args(argv)
    config = HTreeConfig(top_k=args.top_k)
    x = inputs(args.T)
    dense = median_ms(dense_fn(config), x, args.iters)
    print(f"# {jax.devices()[0].device_kind} T={args.T} top_k={args.top_k} layers={config.layer_sizes(args.T)} "
          f"dense cuDNN {dense:.2f} ms", flush=True)
    known = {"auto": None, "highest": Precisions.uniform(lax.Precision.HIGHEST),
             "high": Precisions.uniform(lax.Precision.HIGH), "default": Precisions.uniform(lax.Precision.DEFAULT)}
    precisions = {name: known[name] for name in args.precisions.split(",")}
    for tile, warps, (pname, prec) in itertools.product(
        [int(t) for t in args.tiles.split(",")], [int(w) for w in args.warps.split(",")], precisions.items()
    ):
        bs = BlockSizes(tile=tile, num_warps=warps)
        f = jax.jit(lambda q, k, v, bs=bs, prec=prec: htree_forward_pallas(q, k, v, config, bs, False, prec)[0])
        try:
            ms = median_ms(f, x, args.iters)
            print(f"tile={tile:4d} warps={warps} precision={pname:8s} {ms:9.1f} ms  dense/htree={dense / ms:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"tile={tile} warps={warps} precision={pname}: {type(e).__name__} {str(e)[:150]}", flush=True)


if __name__ == "__main__":
    main()
