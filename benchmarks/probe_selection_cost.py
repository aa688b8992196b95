"""What the selection rule costs each pass (issue 31): the Pallas forward and the
backward alone (given the forward's selections, as training runs it), mean vs bound
(`HTreeConfig.selection`), each backward with the node kernels' spill on
(`BlockSizes.node_entries`: the default 512, 1024, 2048) and off (0), T=131072, bf16, B=1, H=32,
H_kv=4, K=V=128, random inputs; medians of 3 after warm-up, all in one process.

    python benchmarks/probe_selection_cost.py      # on a GPU
"""
import dataclasses

import jax

from htree_jax import HTreeConfig
from htree_jax.bench import INPUTS, median_ms
from pallas_kernels.backward import htree_backward_pallas
from pallas_kernels.forward import htree_forward_pallas
from pallas_kernels.plan import BlockSizes

q, k, v = INPUTS["random"](131072)
for top_k in (512, 64):
    for rule in ("mean", "bound"):
        c = HTreeConfig(top_k=top_k, selection=rule)
        fwd = jax.jit(lambda q, k, v: htree_forward_pallas(q, k, v, c, return_lse=True))
        o, sel, lse = fwd(q, k, v)
        do = jax.random.normal(jax.random.key(3), o.shape, o.dtype)
        line = f"{top_k} {rule} fwd {median_ms(fwd, (q, k, v), 3):.1f}"
        for entries in dict.fromkeys((BlockSizes().node_entries, 512, 1024, 2048, 0)):
            bs = dataclasses.replace(BlockSizes(), node_entries=entries)
            bwd = jax.jit(lambda q, k, v, o, lse, do, sel: htree_backward_pallas(q, k, v, o, lse, do, c, bs,
                                                                                 selections=sel))
            line += f" | bwd node_entries={entries} {median_ms(bwd, (q, k, v, o, lse, do, sel), 3):.1f}"
        print(line, flush=True)
