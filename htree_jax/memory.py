"""What one htree call holds in each device's memory, from XLA's compiled plan, without
running it or allocating its inputs; and a check of that plan against the devices'
free memory, so that a call too large fails on the host, on every device alike, before
any kernel runs (an out-of-memory inside a sharded run leaves the other devices waiting
in their collectives).

    plan = memory_plan(q, k, v, config, gradients=True)    # q, k, v: jax.ShapeDtypeStruct
    plan.check()                                            # MemoryError if it does not fit

`q`, `k`, `v` may be arrays or `jax.ShapeDtypeStruct`s; give them a `sharding`
(`NamedSharding`) for the sharded call (batch, heads or context parallelism along `T`,
`htree_jax/sharding.py`): the plan is then one device's share.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from htree_jax.attention import htree_attention

GIB = 2**30


def readable(nbytes: int) -> str:
    """`nbytes` in GiB, or MiB below one GiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def constant_argument_bytes(lowered) -> int:
    """Bytes of the constant arrays a lowered program takes as arguments (its `main`'s
    arguments marked `jax.const`): from jax 0.12.1 on, constants over 1 KB (RoPE tables,
    masks) are passed to the compiled program beside the inputs instead of being embedded
    in it (`jax_use_simplified_jaxpr_constants`); 0 before."""
    for op in lowered.compiler_ir("stablehlo").body.operations:
        if "sym_name" in op.attributes and op.attributes["sym_name"].value == "main":
            types = op.attributes["function_type"].value.inputs
            attrs = op.attributes["arg_attrs"] if "arg_attrs" in op.attributes else [None] * len(types)
            return sum(math.prod(t.shape) * max(1, int(re.search(r"\d+", str(t.element_type)).group()) // 8)
                       for t, a in zip(types, attrs) if a is not None and "jax.const" in a)
    raise ValueError("the lowered program has no main function")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device holds for one compiled call (XLA's `memory_analysis` of the
    partitioned program): its `arguments` (the inputs, and the `constants` among them),
    `outputs` and `temporaries`; `peak` is their sum, what the device must have free (XLA
    may alias an output to an argument, so the true peak can be lower, never higher).
    `constants`: the bytes of constant arrays the program takes as arguments
    (`constant_argument_bytes`; 0 where the plan was made without the lowered program)."""

    arguments: int
    outputs: int
    temporaries: int
    what: str = "the htree call"
    constants: int = 0

    @classmethod
    def of(cls, compiled, what: str = "the htree call", lowered=None) -> "MemoryPlan":
        """The plan of a compiled call (`jax.jit(f).lower(...).compile()`), its constants
        counted from `lowered` (that call's `Lowered`) where given; `NotImplementedError`
        where XLA gives no memory analysis."""
        stats = compiled.memory_analysis()
        if stats is None:
            raise NotImplementedError(f"XLA gives no memory analysis on {jax.default_backend()}")
        constants = 0 if lowered is None else constant_argument_bytes(lowered)
        return cls(stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.temp_size_in_bytes, what,
                   constants)

    @property
    def inputs(self) -> int:
        """The bytes of the call's own arguments: `arguments` less `constants`."""
        return self.arguments - self.constants

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs + self.temporaries

    def check(self, limit_bytes: int | None = None, devices=None, held=None) -> None:
        """Raises `MemoryError` naming the need and the limit where `peak` exceeds
        `limit_bytes`, or (None) the free memory of any of `devices` (default: every
        device; free = `memory_stats()["bytes_limit"] - ["bytes_in_use"]`). `held`: the
        bytes of the call's arguments that a device already holds (`{device: bytes}`,
        `resident_bytes`), which its `bytes_in_use` counts already, so its need is `peak`
        less them. XLA allocates the temporaries as one buffer: a device whose
        `largest_free_block` is smaller is refused too. Devices that report no limit
        (the CPU) are not checked."""
        held = held or {}
        devices = [] if limit_bytes is not None else jax.devices() if devices is None else devices
        if limit_bytes is not None:
            limits = [("the limit given", int(limit_bytes), 0)]
        else:
            limits = [(str(d), free, held.get(d, 0)) for d in devices if (free := free_bytes(d)) is not None]
        needs = (f"{self.what} needs {readable(self.peak)} on each device (XLA's plan: arguments "
                 f"{readable(self.arguments)}, outputs {readable(self.outputs)}, temporaries "
                 f"{readable(self.temporaries)})")
        advice = "shard the call over more devices (along T the plan falls with the device count), or shorten it"
        for name, free, already in limits:
            if self.peak - already > free:
                beside = f" beside the {readable(already)} of the arguments it holds" if already else ""
                raise MemoryError(f"{needs}; {name} has {readable(free)} free{beside}: {advice}")
        # Free memory in pieces each smaller than the temporaries fails as surely as too
        # little: the allocator cannot split one buffer over its free blocks.
        for d in devices:
            if (block := largest_free_block(d)) is not None and self.temporaries > block:
                raise MemoryError(f"{needs}; the temporaries are one buffer and {d}'s largest free block is "
                                  f"{readable(block)} ({readable(free_bytes(d))} free in all, in pieces): free or "
                                  f"allocate the device's other arrays in fewer pieces, or {advice}")


def largest_free_block(device) -> int | None:
    """The largest allocation `device` can make now, in bytes: its allocator's largest
    free block, or the room it may still reserve, whichever is larger; None where it
    reports no such figure (the CPU)."""
    stats = device.memory_stats() or {}
    if "largest_free_block_bytes" not in stats:
        return None
    room = int(stats["bytes_limit"]) - int(stats["pool_bytes"]) if {"bytes_limit", "pool_bytes"} <= set(stats) else 0
    return max(int(stats["largest_free_block_bytes"]), room)


def resident_bytes(args) -> dict:
    """`{device: bytes}` of the arrays among `args` (a pytree; each array once however
    often it appears) already in each device's memory: a call's existing arguments are
    in its devices' `bytes_in_use` before it runs. `jax.ShapeDtypeStruct`s hold nothing."""
    held, seen = {}, set()
    for x in jax.tree.leaves(args):
        if not isinstance(x, jax.Array) or id(x) in seen or x.is_deleted():
            continue
        seen.add(id(x))
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def free_bytes(device) -> int | None:
    """`device`'s free memory in bytes (its limit less what is in use), None where it
    reports no limit."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def abstract(x):
    """`x` as a `jax.ShapeDtypeStruct`, its sharding kept (None stays None: `v=None`;
    anything without a shape is taken as `jnp.asarray` takes it)."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def memory_plan(q, k, v, config=None, *, gradients: bool = False, backend: str = "auto", block_sizes=None,
                value_dim: int | None = None) -> MemoryPlan:
    """XLA's plan of one device's memory for `htree_attention(q, k, v, config, ...)`
    (`gradients=False`) or for its forward and backward (`gradients=True`: the vjp with a
    cotangent shaped and sharded like the output, as a training step runs it), compiled
    for the default devices but not run: nothing is allocated. `q`, `k`, `v`: arrays or
    `jax.ShapeDtypeStruct`s, sharded or not, as `htree_attention` takes them (unpacked
    rows; `v=None` with `value_dim` for values read from the keys); the other arguments
    as there. On a GPU the Pallas kernels compile, which takes as long as the call's
    first run does."""
    args = [abstract(x) for x in (q, k, v)]

    def forward(q, k, v):
        return htree_attention(q, k, v, config, backend=backend, block_sizes=block_sizes, value_dim=value_dim)

    if gradients:
        out = jax.eval_shape(forward, *args)
        cotangent = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=args[0].sharding)
        fn, args = (lambda q, k, v, do: jax.vjp(forward, q, k, v)[1](do)), args + [cotangent]
    else:
        fn = forward
    lowered = jax.jit(fn).lower(*args)
    return MemoryPlan.of(lowered.compile(), "htree's forward and backward" if gradients else "htree's forward",
                         lowered)


def compile_checked(fn, *args, what: str = "the call", limit_bytes: int | None = None):
    """`jax.jit(fn)` compiled for `args` (arrays or `jax.ShapeDtypeStruct`s, sharded or
    not), its plan checked before anything runs (`MemoryPlan.check`: against
    `limit_bytes`, or None, every device's free memory): returns the compiled executable
    (call it with arrays shaped and sharded like `args`), or raises `MemoryError` naming
    the need and the limit. Arrays among `args` are in their devices' memory already:
    a device's need is the plan less them (`resident_bytes`); `limit_bytes` bounds the
    whole plan. For a whole training step around `htree_attention`, under which an
    out-of-memory on one device leaves the others waiting in their collectives."""
    lowered = jax.jit(fn).lower(*args)
    compiled = lowered.compile()
    MemoryPlan.of(compiled, what, lowered).check(limit_bytes, held=resident_bytes(args))
    return compiled


__all__ = ["MemoryPlan", "compile_checked", "constant_argument_bytes", "free_bytes", "largest_free_block", "memory_plan", "resident_bytes"]
