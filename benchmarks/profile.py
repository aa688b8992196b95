"""Where a pass's time goes, per kernel (GPU): one entry for every pass.

    python -m benchmarks.profile --pass forward --T 131072 --top-k 512
    python -m benchmarks.profile --pass backward --T 131072 --top-k 512
    python -m benchmarks.profile --pass decode [--context 131072] [--batches 1,8] [--top-k 64]
    python -m benchmarks.profile --pass decode --shape mla --batch 64 [--variants "" "span=32"]
    python -m benchmarks.profile --pass one-layer [--sizes 4096,8192] [--batch 1,4]
    python -m benchmarks.profile --pass block-backward --T 131072 [--budgets 4,16,32]
    python -m benchmarks.profile --pass account [--shapes 32/4,32/8] [--sizes 131072,524288]

`--pass` (and `--shape`) choose the profiler in `benchmarks/profiling/`; every other
argument is that profiler's own (`--pass P --help` lists them). The benchmark shape
(H=32, H_kv=4, K=V=128, bf16) unless `--shape mla` (H=128 over one kv head, K=576 with
`rope_dim=64`, V=512: the decode step only). Run it as a module (`python -m`): run as a
file from `benchmarks/`, its name would hide the standard library's `profile`.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.profiling import account, backward, block_backward, decode, decode_mla, forward, one_layer
from htree_jax.cli import DefaultsHelpFormatter

DESCRIPTION = __doc__.split("\n\n")[0]

PROFILERS = {("forward", "benchmark"): forward, ("backward", "benchmark"): backward,
             ("decode", "benchmark"): decode, ("decode", "mla"): decode_mla, ("one-layer", "benchmark"): one_layer,
             ("block-backward", "benchmark"): block_backward, ("account", "benchmark"): account}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=DefaultsHelpFormatter,
                                     add_help=False)
    parser.add_argument("--pass", dest="pass_name", required=True, choices=["forward", "backward", "decode",
                                                                             "one-layer", "block-backward", "account"])
    parser.add_argument("--shape", default="benchmark", choices=["benchmark", "mla"],
                        help="mla: latent attention's decode step (with --pass decode only)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    profiler = PROFILERS.get((args.pass_name, args.shape))
    if profiler is None:
        parser.error(f"--shape {args.shape} is profiled with --pass decode only, not --pass {args.pass_name}")
    return profiler.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
