"""Command line: `python -m htree_jax demo [flags]` and `python -m htree_jax bench [flags]`."""

from __future__ import annotations

import argparse
import sys

from htree_jax.bench import add_bench_arguments, run_bench
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.demo import DemoError, add_demo_arguments, run_demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog="python -m htree_jax",
                                     description="htree attention for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=DefaultsHelpFormatter,
                          help="run htree through the public API and report on it")
    add_demo_arguments(demo)
    bench = sub.add_parser("bench", formatter_class=DefaultsHelpFormatter,
                           help="GPU forward benchmark: htree pallas vs reference vs dense cuDNN")
    add_bench_arguments(bench)
    args = parser.parse_args(argv)  # exits with 2 on unknown or malformed flags
    try:
        if args.command == "bench":
            return run_bench(args, list(sys.argv[2:] if argv is None else argv[1:]))
        return run_demo(args)
    except (DemoError, ValueError, TypeError) as e:
        print(f"python -m htree_jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
