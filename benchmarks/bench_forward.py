"""Forward benchmark (GPU): see `htree_jax/bench.py`; same as `python -m htree_jax bench`."""

import sys

from htree_jax.bench import main

if __name__ == "__main__":
    sys.exit(main())
