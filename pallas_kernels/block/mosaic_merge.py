"""The block merge (`merge._block_merge_kernel`, SPEC 12) on Pallas's Mosaic GPU backend
(`plgpu.kernel`), warp-specialized as JAX's `attention_mgpu` is: one program per `(b,
queries, h_kv)`; one or two consumer warpgroups of 64 rows (the block's `b * G` rows,
padded) fold the candidates into one online softmax in registers, taking turns on the
tensor cores; a memory warpgroup feeds them through a ring of shared-memory stages
(`Pipeline`). The walk is the Triton-lowered kernel's; the two differ where Mosaic GPU
works differently:

- Gathers: each node tile (`r` contiguous rows of a layer, the child block of one kept
  parent) is its own TMA copy into the step's buffer, at a row offset read from the
  parent list in shared memory.
- Rotation (`Pipeline.turn`): RoPE is relative, so a score needs the key turned by
  its buffer position `p` against the row's angle `n - 1`. With `"queries"` (the
  default) no key is rotated in the kernel: each layer's keys come in `tile / r`
  copies rotated in XLA by `p % tile`, their offset within a step (`turned_keys`; the
  offset of node tile `v` of a step is `v * r + c`, whatever the parent list says),
  and each consumer turns its rows, held in float32 registers, back by the step's
  first position before scoring (one row of tables a step). With `"keys"` the keys of
  each landed tile are rotated in place by the memory warpgroup, or a rotator
  warpgroup of its own, their angle added in float32 from a chunk's base and a local
  table. `Pipeline.absolute_top` (the default layouts', measured 1.8-2.6% faster): the
  top layer's node `n` sits at buffer position `n` in every block, so its keys come
  rotated by `n` and its steps turn no row. Both round each operand once, as the Pallas-Triton merge does, but not the
  same numbers: against it the outputs differ by the dtype's rounding (RESULTS).
- Queries: rotated by their row's angle in XLA, once per layer (`rotated_queries`),
  because a row's angle is a gather of table rows by a per-row index.
- Layers: one that refines every candidate it has (the top layer wherever it has at
  most `top_k` nodes) takes no step.
- Masks: the set a layer refines is a bitmap over buffer positions built in XLA
  (`refined_bitmaps`: a scatter of `top_k` bits a block), read one word of 32
  positions at a time and decided per column, instead of comparing each tile with a
  window of the sorted list.

Inputs in bfloat16 or float16 only (WGMMA takes float32 operands as TF32: the float32
path's exact dots have no Mosaic GPU form here). Needs a Hopper GPU; Mosaic GPU's CPU
interpret mode cannot run WGMMA, so the tests that run this kernel are GPU-marked
(`tests/test_block_routes.py`, the gate's route cases); its twin is the Pallas-Triton
merge (`merge.py`), which CI runs interpreted. Speeds by layout:
`tools/probes/block_merge_pipelines.py` (RESULTS).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from htree_jax.core.indexing import candidate_count
from pallas_kernels.block.merge import (PAST_NODES, BlockLaunch, BlockStatic, layer_parent_counts, rope_tables,
                                       rotate_back, rotate_halves)
from pallas_kernels.shared.common import next_power_of_two
from pallas_kernels.shared.shared_memory import LIMIT

TILE = 128  # the most candidates a step of any layout (`pipeline_for`): a WGMMA N, whole bitmap words
ROWS = 64  # rows a consumer warpgroup holds (WGMMA's M)
WORD = 32  # positions a bitmap word holds
TMA_ROWS = 256  # the most elements a TMA copy moves along a dimension
DTYPES = (jnp.bfloat16, jnp.float16)
# What `check_mosaic_dims` takes (the reasons in its docstring): compression rates, the
# padded `K / 2` and `V`, rows a program.
RATES, HALVES, VALUE_DIMS, MAX_PROGRAM_ROWS = (8, 16, 32, 64), (32, 64), (64, 128), 128


def spoken(values) -> str:
    """`(8, 16, 32)` -> `"8, 16 or 32"`."""
    values = [str(x) for x in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def check_mosaic_dims(r: int, rows: int, K: int, V: int, dtype) -> None:
    """What this kernel takes; a ValueError naming the rule otherwise: bfloat16 or
    float16, `compression_rate` 8, 16, 32 or 64 (a node tile is whole 8-row tiles of
    shared memory, and `TILE` whole node tiles), at most 128 rows a program, `K / 2` 32
    or 64 and `V` 64 or 128 (padded to powers of two: a half is one WGMMA operand of
    whole 64-byte swizzles; at K = V = 256 the buffers pass the 227 KiB of shared
    memory a block has)."""
    rules = []
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        rules.append(f"bfloat16 or float16 inputs (got {jnp.dtype(dtype).name})")
    if r not in RATES:
        rules.append(f"compression_rate {spoken(RATES)} (got {r})")
    if rows > MAX_PROGRAM_ROWS:
        rules.append(f"at most {MAX_PROGRAM_ROWS} rows a program (got {rows})")
    half, vp = next_power_of_two(K // 2, 16), next_power_of_two(V, 16)
    if half not in HALVES or vp not in VALUE_DIMS:
        rules.append(f"K / 2 of {spoken(HALVES)} and V of {spoken(VALUE_DIMS)}, padded to powers of two (got K = "
                     f"{K}, V = {V})")
    if rules:
        raise ValueError("BlockKernels(merge='mosaic_gpu') takes " + "; ".join(rules) + ": use BlockKernels(merge='pallas_triton')")


def program_rows(st: BlockStatic) -> int:
    """A program's rows as the warpgroup holds them: 64 or 128 (WGMMA's M is 64 a
    step); `st.rows` real, the rest zero queries whose outputs are dropped."""
    return 64 if st.rows <= 64 else 128


def _transforms(minor: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for a `[rows, minor]` operand of `dtype`."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def refined_bitmaps(selections, st: BlockStatic, words: int, firsts=None):
    """Each layer above 0 (top first, as `selections`): bit `p` set where buffer
    position `p` holds a node the layer refines, or (`firsts [B, NB]`, packed rows laid
    out virtually) on the top layer a node before the block's document's first: both
    are not merged. `[L - 1, B, NB, H_kv, words]` int32.
    A refined node `n` of layer `l` sits at `p = n` in the top layer, else at `s * r + n
    % r` with `s` its parent's slot in the list of layer `l + 1` (the lists are sorted).
    One scatter of `top_k` bits a list (each position once: the add is an OR)."""
    r = st.r
    maps = []
    for index, refined in enumerate(selections):  # index 0: layer L - 1
        refined = refined[..., : st.top_k]
        if index == 0:
            p = refined
        else:
            parents = selections[index - 1][..., : st.top_k]
            slot = jnp.vectorize(jnp.searchsorted, signature="(k),(k)->(k)")(parents, refined // r)
            p = slot * r + refined % r
        listed = refined < PAST_NODES
        p = jnp.where(listed, p, 0)
        bit = jnp.where(listed, jnp.left_shift(jnp.uint32(1), (p % WORD).astype(jnp.uint32)), jnp.uint32(0))
        lead = refined.shape[:-1]
        flat_p, flat_bit = p.reshape(-1, st.top_k) // WORD, bit.reshape(-1, st.top_k)
        lists = jnp.arange(flat_p.shape[0])[:, None]
        bits = jnp.zeros((flat_p.shape[0], words), jnp.uint32).at[lists, flat_p].add(flat_bit)
        if index == 0 and firsts is not None:  # the top layer: other documents' nodes
            bits = bits | jnp.broadcast_to(earlier_bits(firsts, words)[:, :, None], lead + (words,)).reshape(bits.shape)
        maps.append(lax.bitcast_convert_type(bits, jnp.int32).reshape(lead + (words,)))
    return jnp.stack(maps)


def count_entries(num_layers: int, packed: bool, shard: bool) -> int:
    """The counts' length `Lp` (`merge.layer_parent_counts`' power of two of at least 4,
    doubled until the entries after the layers' fit: `with_firsts`, `with_offset`)."""
    lp = max(4, 1 << (num_layers - 1).bit_length())
    while lp < num_layers + (2 if shard else 1 if packed else 0):
        lp *= 2
    return lp


def with_entries(counts, length: int):
    """`counts [B, NB, H_kv, Lp]` zero-padded to `length` entries."""
    return jnp.pad(counts, [(0, 0)] * 3 + [(0, length - counts.shape[-1])])


def with_firsts(counts, firsts, num_layers: int):
    """Packed rows: the counts `[B, NB, H_kv, Lp]` (`merge.layer_parent_counts`) with
    each block's document's first top node `firsts [B, NB]` in entry `num_layers`, `Lp`
    doubled where no entry follows the layers'."""
    counts = with_entries(counts, max(counts.shape[-1], count_entries(num_layers, True, False)))
    return counts.at[..., num_layers].set(firsts[:, :, None].astype(jnp.int32))


def with_offset(counts, offset, num_layers: int):
    """A context shard's rows: the counts with its first position `offset` in entry
    `num_layers + 1` of every block."""
    counts = with_entries(counts, max(counts.shape[-1], count_entries(num_layers, False, True)))
    return counts.at[..., num_layers + 1].set(jnp.asarray(offset, jnp.int32))


def earlier_bits(firsts, words: int):
    """`firsts [B, NB]` -> `[B, NB, words]` uint32: bit `p` set where `p < first`."""
    before = jnp.arange(words * WORD, dtype=jnp.int32) < firsts[..., None]  # [B, NB, words * WORD]
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD, dtype=jnp.uint32))
    return jnp.sum(before.reshape(firsts.shape + (words, WORD)).astype(jnp.uint32) * weights, axis=-1,
                   dtype=jnp.uint32)


def row_angles(counts, Tp: int, st: BlockStatic, offset=None):
    """Each layer's row angle `n - 1` (SPEC 2.2) of `Tp` positions: `[L, B, Tp, H_kv]`
    int32 from the counts `[B, NB, H_kv, Lp]` (`merge.layer_parent_counts`). `offset`: a
    context shard's first position (its rows' positions from there)."""
    L, r = st.num_layers, st.r
    t = jnp.arange(Tp, dtype=jnp.int32)
    block_of = t // r
    starts = block_of * r
    if offset is not None:
        t, starts = t + offset, starts + offset
    return jnp.stack([candidate_count(counts[..., l][:, block_of], (t if l == 0 else starts)[None, :, None], r, l) - 1
                      for l in range(L)])


def program_layout(x, st: BlockStatic, rows: int, lead: int = 0):
    """Per-row arrays `[*lead, B, Tp, H_kv, Gp, *tail]` (`lead` leading axes) laid out a
    program's rows together: `[*lead, B, Tp / queries, H_kv, rows, *tail]`, each
    program's `queries * Gp` rows (query-major) zero-padded to `rows`."""
    shape = x.shape
    B, Tp, H_kv, gp = shape[lead: lead + 4]
    tail = shape[lead + 4:]
    x = x.reshape(shape[:lead] + (B, Tp // st.queries, st.queries, H_kv, gp) + tail)
    x = jnp.moveaxis(x, lead + 2, lead + 3).reshape(shape[:lead] + (B, Tp // st.queries, H_kv, st.queries * gp) + tail)
    return jnp.pad(x, [(0, 0)] * (lead + 3) + [(0, rows - st.queries * gp)] + [(0, 0)] * len(tail))


def from_program_layout(x, st: BlockStatic, gp: int, lead: int = 0):
    """`program_layout`'s inverse: `[*lead, B, NJ, H_kv, rows, *tail]` -> `[*lead, B, NJ *
    queries, H_kv, Gp, *tail]`, the padded rows dropped."""
    shape = x.shape
    B, nj, H_kv = shape[lead: lead + 3]
    tail = shape[lead + 4:]
    x = lax.slice_in_dim(x, 0, st.queries * gp, axis=lead + 3)
    x = x.reshape(shape[:lead] + (B, nj, H_kv, st.queries, gp) + tail)
    return jnp.moveaxis(x, lead + 3, lead + 2).reshape(shape[:lead] + (B, nj * st.queries, H_kv, gp) + tail)


def rotated_queries(q5, counts, cos, sin, st: BlockStatic, rows: int, dtype=None, offset=None):
    """Each layer's queries rotated by their row's angle `n - 1` (`row_angles`), laid out a
    program's rows together: `q5 [B, Tp, H_kv, Gp, 2 * half]` -> `(lo, hi)` each `[L, B,
    Tp / queries, H_kv, rows, half]` in `dtype` (q's where None). `offset`: a context
    shard's first position (its rows' positions from there)."""
    h = st.half
    angle = row_angles(counts, q5.shape[1], st, offset)  # [L, B, Tp, H_kv]
    lo, hi = q5[..., :h].astype(jnp.float32), q5[..., h:].astype(jnp.float32)
    c, s = cos[angle][..., None, :], sin[angle][..., None, :]  # [L, B, Tp, H_kv, 1, h]
    lay_out = lambda x: program_layout(x, st, rows, lead=1).astype(dtype or q5.dtype)
    return lay_out(lo * c - hi * s), lay_out(lo * s + hi * c)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How the Mosaic GPU merge is laid out on one multiprocessor: `tile` candidates a
    step (a WGMMA's N: 64 or 128), `stages` of them in the shared-memory ring (keys,
    values and the step's base angles), and the registers a thread of a consumer and of
    the memory warpgroup keeps (`setmaxnreg`, each a multiple of 8). With
    `rotator_registers` 0 the memory warpgroup rotates each landed tile between its
    copies; else a warpgroup of its own does, with that many registers, and the memory
    warpgroup only copies (`2 * consumer + memory + rotator <= 512`). `turn="queries"`
    rotates no key in the kernel: each key comes rotated (XLA, once a call) by its
    offset within a step, and each consumer turns its float32 rows back by the step's
    first position in registers (`turned_keys`), held there across a layer
    (`hold_rows`) or read again from shared memory each step. `absolute_top` (turned
    only): the top layer's buffer position of node `n` is `n` in every block, so its keys
    come rotated by it (XLA, one copy instead of `tile / r`) and its steps turn no row.
    `ablate` is for probes only
    (`tools/probes/`): it drops the keys' rotation (turned: the rows' turn) or the mask,
    and the result is then wrong."""

    tile: int = 64
    stages: int = 2
    consumer_registers: int = 176
    memory_registers: int = 152
    rotator_registers: int = 0
    turn: str = "keys"
    hold_rows: bool = True
    absolute_top: bool = False
    ablate: str = ""

    def __post_init__(self):
        if self.tile not in (64, 128) or self.stages < 2:
            raise ValueError(f"Pipeline: tile 64 or 128, stages >= 2 ({self})")
        registers = [self.consumer_registers, self.memory_registers] + [self.rotator_registers] * bool(
            self.rotator_registers)
        if 2 * self.consumer_registers + self.memory_registers + self.rotator_registers > 512 or any(
                n % 8 or not 24 <= n <= 256 for n in registers):
            raise ValueError(f"Pipeline: 2 * consumer + memory + rotator registers <= 512, each a multiple of 8 "
                             f"in 24..256 ({self})")
        # A launch gives each of its 128-thread warpgroups' threads at most 65536 / threads
        # registers; `setmaxnreg` moves them from the copying warpgroups to the consumers,
        # and a decrease past that count is an illegal instruction (measured at 4).
        launch = 65536 // (128 * (3 + bool(self.rotator_registers))) // 8 * 8
        if max(self.memory_registers, self.rotator_registers) > launch or self.consumer_registers < launch:
            raise ValueError(f"Pipeline: memory and rotator registers at most, consumer registers at least "
                             f"{launch} (a launch's share at {3 + bool(self.rotator_registers)} warpgroups) ({self})")
        if self.ablate not in ("", "rotation", "mask", "both"):
            raise ValueError(f"Pipeline: ablate '', 'rotation', 'mask' or 'both' ({self})")
        if self.turn not in ("keys", "queries") or (self.turn == "queries" and self.rotator_registers):
            raise ValueError(f"Pipeline: turn 'keys' or 'queries', the latter with no rotator ({self})")
        if self.absolute_top and self.turn != "queries":
            raise ValueError(f"Pipeline: absolute_top with turn='queries' only ({self})")
        if self.tile == 128 and self.turn == "keys" and not self.rotator_registers:
            raise ValueError(f"Pipeline: at tile 128 the keys take a rotator warpgroup or turned queries: the memory "
                             f"warpgroup rotating them hung on the H200 (journal, 2026-12-02 (1)) ({self})")

    @property
    def rotator(self) -> bool:
        """Whether a warpgroup of its own rotates the keys."""
        return self.rotator_registers > 0

    @property
    def turned(self) -> bool:
        """Whether the consumers turn their rows instead of the keys being rotated."""
        return self.turn == "queries"

    @property
    def chunks(self) -> int:
        """Base angles a step: one turned; else one a chunk of `ROWS` keys rotated."""
        return 1 if self.turned else self.tile // ROWS


# The measured layouts (RESULTS, "Step 4"): 128 candidates a step, the rows read from
# shared memory each step (held in registers they spill), turned once per 128 keys
# below the top layer; 64 a step with the rows held where 128 would take `128 / r`
# turned copies of the keys past 8 (`turned_keys`).
PIPELINE = Pipeline(tile=TILE, stages=2, consumer_registers=232, memory_registers=40, turn="queries",
                    hold_rows=False, absolute_top=True)
NARROW_PIPELINE = Pipeline(tile=64, stages=4, consumer_registers=232, memory_registers=40, turn="queries",
                           absolute_top=True)


def pipeline_for(st: BlockStatic) -> Pipeline:
    """The layout a launch takes by default: `PIPELINE` at `compression_rate` 16 and
    up, `NARROW_PIPELINE` below (its key copies, `tile / r`, half as many)."""
    return PIPELINE if st.r >= 16 else NARROW_PIPELINE
LOG2E = math.log2(math.e)


def shifted_position(count_s, t, num_layers: int, shard: bool):
    """A position of a program's rows in the tree's sequence: plus a context shard's
    offset (`count_s[L + 1]`, a multiple of `b`; `with_offset`), read once the counts
    have landed in shared memory."""
    return t + count_s[num_layers + 1] if shard else t


def layer_bounds(count_s, l: int, *, st: BlockStatic, tile: int, t_first, t0, packed: bool, shard: bool):
    """`(n_P, n_max, start, stop)` of layer `l` for a program whose rows start at
    `t_first` (block start `t0`), its counts in shared memory (`count_s`: `n_P` of each
    layer, then `with_firsts`' and `with_offset`'s entries): the block's most candidates
    `n` and its steps `start .. stop - 1` of `tile` candidates; none above layer 0 where
    the layer refines all its candidates (its list, `n_P` of layer `l - 1`, is as
    long), as the top layer does wherever it has at most `top_k` nodes. Packed rows
    start the top layer at the step of the document's first node (`count_s[L]`,
    `merge.walk_tiles`), whose candidates are the nodes from it to `n`."""
    L, r = st.num_layers, st.r
    n_parents = count_s[l]
    n_max = candidate_count(n_parents, shifted_position(count_s, t_first + st.queries - 1 if l == 0 else t0, L, shard),
                            r, l)
    stop = (n_max + tile - 1) // tile
    skips = packed and l == L - 1
    first = count_s[L] if skips else None
    if l > 0:
        stop = jnp.where(count_s[l - 1] >= (n_max - first if skips else n_max), 0, stop)
    return n_parents, n_max, jnp.minimum(first // tile, stop) if skips else 0, stop


def node_first_row(sel_s, at, *, layer: int, st: BlockStatic, n_max, lcols: int):
    """The layer's first row of the node tile at buffer slot `at` (a step's tiles from
    `i * tile / r`): the top layer's slot `at` holds node tile `at`; below it the tile
    of entry `at` of the parent list (`sel_s [L - 1, rows, lcols]` in shared memory, top
    layer first). Row 0 past `n_max` (padding no row merges)."""
    r, L = st.r, st.num_layers
    if layer == L - 1:
        first = at * r
    else:
        entry = jnp.minimum(at, st.top_k - 1)
        first = sel_s[L - 2 - layer, entry // lcols, entry % lcols] * r
    return jnp.where(at * r < n_max, first, 0)


def unmerged_at_minus_inf(s, i, *, layer: int, num_layers: int, tile: int, col, n_row, n_max, bits_s, wcols: int):
    """Step `i`'s scores `s [ROWS, tile]` with those the layer does not merge at `-inf`:
    at layer 0 the positions past each row's `n` (`n_row`, in WGMMA's row layout), above
    it those past `n_max` and those the layer's bitmap marks refined (`bits_s [L - 1,
    rows, wcols]` in shared memory, top layer first; one word of 32 positions at a
    time), decided per column (`col`, the step's column iota in the column layout)."""
    if layer == 0:
        limit = lax.broadcast_in_dim(n_row - i * tile, s.shape, [0])
        return jnp.where(lax.broadcast_in_dim(col, s.shape, [1]) < limit, s, -jnp.inf)
    at = lambda w: i * (tile // WORD) + w
    word = lambda w: col * 0 + bits_s[num_layers - 1 - layer, at(w) // wcols, at(w) % wcols]
    bits = word(0)
    for w in range(1, tile // WORD):
        bits = jnp.where(col >= w * WORD, word(w), bits)
    refined = lax.shift_right_logical(bits, col % WORD) & 1
    bias = jnp.where((col < n_max - i * tile) & (refined == 0), 0.0, -jnp.inf)
    return s + lax.broadcast_in_dim(bias, s.shape, [1])


def _merge_kernel(q_lo_ref, q_hi_ref, *refs, st: BlockStatic, consumers: int, words: tuple[int, int],
                  lists: tuple[int, int], dtype, pipe: Pipeline, packed: bool = False, shard: bool = False):
    """One program per `(b, queries, h_kv)`: `consumers` warpgroups of `ROWS` rows each
    fold every layer's merged candidates into one online softmax; the last warpgroup
    feeds them by TMA, a ring of `pipe.stages` tiles of `pipe.tile` candidates, each
    tile `pipe.tile / r` node tiles gathered at the rows the layer's parent list names
    (SPEC 12), and (`pipe.turn="keys"`) each landed tile's keys are rotated while the
    next tile's copies fly, or (`"queries"`) each consumer turns its rows by the step's
    base angle. Two consumers take turns on the tensor cores (`schedule`), as
    `attention_mgpu` does."""
    L, r, C, h, vp, S = st.num_layers, st.r, pipe.tile, st.half, st.vp, pipe.stages
    turned, chunks = pipe.turned, pipe.chunks
    tables, refs = refs[: 2 if turned else 4], refs[2 if turned else 4:]
    lcos_ref, lsin_ref = (None, None) if turned else tables[:2]
    bcos_ref, bsin_ref = tables[-2:]  # a step's base angles, a row a chunk of `C // chunks` positions
    sel_ref, count_ref, bits_ref, *refs = refs
    layer_refs = refs[: 3 * L]  # bottom first: keys' halves, values
    o_ref, lse_ref = refs[3 * L: 3 * L + 2]
    scratch, bars = refs[3 * L + 2:]
    rotate = pipe.ablate not in ("rotation", "both")
    mask = pipe.ablate not in ("mask", "both")
    q_lo_s, q_hi_s, k_lo_s, k_hi_s, v_s, *scratch = scratch
    lcos_s, lsin_s = (None, None) if turned else scratch[:2]
    bcos_s, bsin_s, sel_s, bits_s, count_s, lse_s = scratch[-6:]
    if turned:
        setup, q_bars, k_bars, v_bars, k_done, v_done, schedule, finished = bars
        landed = None
    else:
        setup, q_bars, landed, k_bars, v_bars, k_done, v_done, schedule, finished = bars
    b, j, hk, wg = lax.axis_index("b"), lax.axis_index("j"), lax.axis_index("h"), lax.axis_index("wg")
    t_first = j * st.queries  # the program's first row, in the shard's rows
    t0 = t_first - t_first % r
    blk = t_first // r

    def shifted(t):
        return shifted_position(count_s, t, L, shard)
    node_tiles = C // r
    wrows, wcols = words
    lrows, lcols = lists

    def layer_counts(l):
        return layer_bounds(count_s, l, st=st, tile=C, t_first=t_first, t0=t0, packed=packed, shard=shard)

    def layer_steps(l):
        _, _, start, stop = layer_counts(l)
        return stop - start if packed and l == L - 1 else stop

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def column(ref):
        """A `[half]` row of a table in shared memory, broadcast to `[ROWS, half]`."""
        return lax.broadcast_in_dim(plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA.reduce(0)), (ROWS, h), [1])

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(pipe.consumer_registers, action="increase")
        my_rows = pl.ds(wg * ROWS, ROWS)
        row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        # The mask's operands as row and column vectors, broadcast where used: a `[ROWS,
        # C]` iota held across the loop takes the registers the scores need.
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=row_layout) + wg * ROWS
        col = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=col_layout)
        scale = st.alpha * LOG2E  # the softmax in base 2, as attention_mgpu's

        def load_queries(l):
            """Layer `l`'s rows; turning them per step, as float32 arrays (`[ROWS, half]` x
            2, held across the layer), else as the scores' operands in shared memory."""
            plgpu.copy_gmem_to_smem(q_lo_ref.at[l, b, j, hk, my_rows], q_lo_s.at[wg], q_bars.at[wg])
            plgpu.copy_gmem_to_smem(q_hi_ref.at[l, b, j, hk, my_rows], q_hi_s.at[wg], q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            refs = (q_lo_s.at[wg], q_hi_s.at[wg])
            return tuple(x[...] for x in refs) if turned and pipe.hold_rows else refs

        rows_q = load_queries(L - 1)
        plgpu.barrier_wait(setup)
        total_steps = sum(layer_steps(l) for l in range(L))
        m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
        total = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.zeros((ROWS, vp), jnp.float32), plgpu.Layout.WGMMA)
        g = jnp.int32(0)
        plgpu.barrier_wait(k_bars.at[0])
        if consumers == 2:
            pl.when(wg == 1)(schedule_barrier)
        for l in reversed(range(L)):
            if l != L - 1:
                rows_q = load_queries(l)
            n_parents, n_max, start, stop = layer_counts(l)
            n_row = candidate_count(n_parents, shifted(t_first + row // st.group), r, 0) if l == 0 else None

            def merged_scores(s, i, l=l, n_max=n_max, n_row=n_row):
                return unmerged_at_minus_inf(s, i, layer=l, num_layers=L, tile=C, col=col, n_row=n_row,
                                             n_max=n_max, bits_s=bits_s, wcols=wcols)

            absolute = pipe.absolute_top and l == L - 1  # the keys at their buffer positions

            def step(i, carry, merged_scores=merged_scores, rows_q=rows_q, absolute=absolute):
                acc, m, total, g = carry
                slot = lax.rem(g, S)
                if turned:  # the rows turned back by the step's first position (`merge.rotate_back`), but where
                    # the keys sit at their buffer positions (`absolute`)
                    rows = rows_q if pipe.hold_rows else tuple(x[...] for x in rows_q)
                    lo, hi = rotate_back(*rows, column(bcos_s.at[slot, 0]), column(bsin_s.at[slot, 0])) if (
                        rotate and not absolute) else rows
                    a_lo, a_hi = lo.astype(dtype), hi.astype(dtype)
                else:
                    a_lo, a_hi = rows_q

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, a_lo, k_lo_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(acc_ref, a_hi, k_hi_s.at[slot].transpose((1, 0)))
                    if consumers == 2:
                        schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, C), jnp.float32)) * scale
                plgpu.barrier_arrive(k_done.at[slot])
                if mask:
                    s = merged_scores(s, i)
                # `pallas_kernels.shared.softmax.fold` of one tile, transcribed (base 2,
                # WGMMA's product, the broadcasts Mosaic GPU's layouts take).
                m_new = jnp.maximum(m, s.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                decay = jnp.exp2(m - m_safe)
                w_ = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                total = total * decay + w_.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(decay, acc.shape, [0])
                w16 = w_.astype(dtype)
                if consumers == 2:
                    acc, total, m_new, w16 = lax.optimization_barrier((acc, total, m_new, w16))
                    plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(v_bars.at[slot])
                if consumers == 2:
                    plgpu.barrier_wait(schedule)

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, w16, v_s.at[slot])

                    @pl.when(g + 1 < total_steps)
                    def _():  # the next tile's keys, while the product runs
                        plgpu.barrier_wait(k_bars.at[lax.rem(g + 1, S)])

                acc = pl.run_state(values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, m_new, total, g + 1

            acc, m, total, g = lax.fori_loop(start, stop, step, (acc, m, total, g))
        if consumers == 2:
            pl.when(wg == 0)(schedule_barrier)
        # The rows' output takes a values buffer once every consumer's last product is
        # done (the memory warpgroup has nothing left in flight by then).
        plgpu.barrier_arrive(finished)
        plgpu.barrier_wait(finished)
        o_s = v_s.at[wg] if C == ROWS else v_s.at[0, my_rows]
        # `softmax.normalized` and `softmax.log_sum_exp`, transcribed (base 2 back to e).
        o_s[...] = (acc / lax.broadcast_in_dim(total, acc.shape, [0])).astype(dtype)
        lse_s.at[wg][...] = (m + jnp.log2(total)) / LOG2E
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, j, hk, my_rows])
        plgpu.copy_smem_to_gmem(lse_s.at[wg], lse_ref.at[b, j, hk, my_rows])
        plgpu.wait_smem_to_gmem(0)

    def rotate_tile(slot):
        """The keys landed in `slot` rotated in place by their buffer positions `i * C +
        c` (SPEC 2.2, `merge.rotate_halves`, in float32): the angle of `c = 64 a + d` is
        the step's base angle of chunk `a` (a row of `bcos`, `bsin`) plus the program's
        local angle of `d` (`lcos`, `lsin`), added in float32 (`cos(x + y) = cos x cos y -
        sin x sin y`), so that a step copies one row of tables a chunk, not one a key."""
        cl, sl = lcos_s[...], lsin_s[...]
        for a in range(C // ROWS):
            rows = pl.ds(a * ROWS, ROWS)
            cb, sb = column(bcos_s.at[slot, a]), column(bsin_s.at[slot, a])
            c, s_ = cb * cl - sb * sl, sb * cl + cb * sl
            k_lo = k_lo_s.at[slot, rows][...].astype(jnp.float32)
            k_hi = k_hi_s.at[slot, rows][...].astype(jnp.float32)
            k_lo_s.at[slot, rows][...] = (k_lo * c - k_hi * s_).astype(dtype)
            k_hi_s.at[slot, rows][...] = (k_lo * s_ + k_hi * c).astype(dtype)

    def finish(g):
        """Step `g`'s keys, once landed, rotated and handed to the consumers."""
        slot = lax.rem(g, S)
        plgpu.barrier_wait(landed.at[slot])
        if rotate:
            rotate_tile(slot)
            plgpu.commit_smem()
        plgpu.barrier_arrive(k_bars.at[slot])

    @pl.when(wg == consumers)
    def _memory():
        plgpu.set_max_registers(pipe.memory_registers, action="decrease")
        plgpu.copy_gmem_to_smem(count_ref.at[b, blk, hk], count_s, setup)
        plgpu.copy_gmem_to_smem(sel_ref.at[b, blk, hk], sel_s, setup)
        plgpu.copy_gmem_to_smem(bits_ref.at[b, blk, hk], bits_s, setup)
        if not turned:
            plgpu.copy_gmem_to_smem(lcos_ref, lcos_s, setup)
            plgpu.copy_gmem_to_smem(lsin_ref, lsin_s, setup)
        plgpu.barrier_wait(setup)
        g = jnp.int32(0)
        for l in reversed(range(L)):
            k_lo_ref, k_hi_ref, v_ref = layer_refs[3 * l: 3 * l + 3]
            _, n_max, start, stop = layer_counts(l)
            top = l == L - 1

            def node_rows(i, jn, n_max=n_max, l=l):
                return node_first_row(sel_s, i * node_tiles + jn, layer=l, st=st, n_max=n_max, lcols=lcols)

            def produce(i, g, k_lo_ref=k_lo_ref, k_hi_ref=k_hi_ref, v_ref=v_ref, node_rows=node_rows):
                """Step `g`'s copies; without a rotator warpgroup, then the previous
                step's rotation while they fly. The order keeps the ring live at two
                stages: the consumers' wait for step `g - 1`'s keys comes before they
                give back step `g - 2`'s values."""
                slot = lax.rem(g, S)
                arrive = k_bars.at[slot] if turned else landed.at[slot]

                @pl.when(g >= S)
                def _():
                    plgpu.barrier_wait(k_done.at[slot])

                for jn in range(node_tiles):
                    start, rows_at = node_rows(i, jn), pl.ds(jn * r, r)
                    # Turned, node tile `jn` of a step comes from the copy of the layer
                    # rotated by `jn * r + c`, its offset within the step (`absolute_top`:
                    # the top layer's one copy, rotated by the buffer position itself).
                    copy = 0 if pipe.absolute_top and top else jn
                    src = (lambda ref, copy=copy: ref.at[copy, b, hk, pl.ds(start, r)]) if turned else (
                        lambda ref: ref.at[b, hk, pl.ds(start, r)])
                    plgpu.copy_gmem_to_smem(src(k_lo_ref), k_lo_s.at[slot, rows_at], arrive)
                    plgpu.copy_gmem_to_smem(src(k_hi_ref), k_hi_s.at[slot, rows_at], arrive)
                step_rows = pl.ds(i * chunks, chunks)
                plgpu.copy_gmem_to_smem(bcos_ref.at[step_rows], bcos_s.at[slot], arrive)
                plgpu.copy_gmem_to_smem(bsin_ref.at[step_rows], bsin_s.at[slot], arrive)
                if not (pipe.rotator or turned):
                    pl.when(g >= 1)(lambda: finish(g - 1))

                @pl.when(g >= S)
                def _():
                    plgpu.barrier_wait(v_done.at[slot])

                for jn in range(node_tiles):
                    start = node_rows(i, jn)
                    plgpu.copy_gmem_to_smem(v_ref.at[b, hk, pl.ds(start, r)], v_s.at[slot, pl.ds(jn * r, r)],
                                            v_bars.at[slot])
                return g + 1

            g = lax.fori_loop(start, stop, produce, g)
        if not (pipe.rotator or turned):
            pl.when(g >= 1)(lambda: finish(g - 1))

    if pipe.rotator:
        @pl.when(wg == consumers + 1)
        def _rotator():
            plgpu.set_max_registers(pipe.rotator_registers, action="decrease")
            plgpu.barrier_wait(setup)
            total_steps = sum(layer_steps(l) for l in range(L))

            @pl.loop(0, total_steps)
            def _(g):
                finish(g)


def split_layers(layers, st: BlockStatic):
    """`layer_arrays`' `[K_l, V_l, ...]` -> `[K_l lo half, K_l hi half, V_l, ...]`: WGMMA
    reads each half as its own operand."""
    out = []
    for kl, vl in zip(layers[0::2], layers[1::2]):
        out += [kl[..., : st.half], kl[..., st.half:], vl]
    return out


def turned_keys(layers, cos, sin, st: BlockStatic, tile: int, absolute_top: bool = False):
    """`split_layers`' keys, each in `tile / r` copies: copy `v` holds row `n` rotated by
    `v * r + n % r` (float32, then rounded to the keys' dtype once), the offset within a
    step of `tile` positions of node tile `v` of the step, so that the kernel turns
    only the queries, by the step's first position. `[B, H_kv, Np, half]` -> `[tile / r,
    B, H_kv, Np, half]`; values as they are. Memory: `tile / r` times the keys of every
    layer for the call (8x at r=16 and `PIPELINE`'s 128 a step: about 1.1 GB at the
    benchmark shape's T=131072, 4.4 GB at 524288). `absolute_top`: the top layer in one
    copy, row `n` rotated by `n` (its buffer position in every block; rows past the
    tables, padding no block merges, by the last)."""
    r, out = st.r, []
    triples = list(zip(layers[0::3], layers[1::3], layers[2::3]))
    for index, (k_lo, k_hi, vl) in enumerate(triples):
        n = k_lo.shape[2]
        if absolute_top and index == len(triples) - 1:
            offset = jnp.minimum(jnp.arange(n), cos.shape[0] - 1)[None, :]  # [1, Np]
        else:
            offset = jnp.arange(tile // r)[:, None] * r + jnp.arange(n)[None, :] % r  # [copies, Np]
        c, s_ = cos[offset][:, None, None], sin[offset][:, None, None]
        lo, hi = rotate_halves(k_lo.astype(jnp.float32)[None], k_hi.astype(jnp.float32)[None], c, s_)
        out += [lo.astype(k_lo.dtype), hi.astype(k_hi.dtype), vl]
    return out


def tma_boxes(n: int) -> tuple[int, int]:
    """`n` entries (a power of two) as `(rows, cols)` of a TMA box: at most `TMA_ROWS`
    entries along a dimension, at least 16 bytes of int32 along the last."""
    cols = max(4, min(n, TMA_ROWS))
    return max(1, n // cols), cols


def per_program_lists(x, boxes: tuple[int, int]):
    """`[L', B, NB, H_kv, n]` int32 -> `[B, NB, H_kv, L', rows, cols]`: a program's lists
    of every layer one TMA copy."""
    x = jnp.pad(x, [(0, 0)] * 4 + [(0, boxes[0] * boxes[1] - x.shape[-1])])
    return jnp.moveaxis(x.reshape(x.shape[:4] + boxes), 0, 3)


def scratch_shapes(st: BlockStatic, pipe: Pipeline, dtype, list_shape, word_shape, count_len: int):
    """The kernel's shared memory, one `plgpu.SMEM` a buffer (`_merge_kernel` unpacks them
    in this order)."""
    consumers, C, S = program_rows(st) // ROWS, pipe.tile, pipe.stages
    tr = lambda minor, dt=dtype: _transforms(minor, dt)
    q_dtype = jnp.float32 if pipe.turned else dtype  # turned per step in float32 registers
    local = [] if pipe.turned else [
        plgpu.SMEM((ROWS, st.half), jnp.float32, transforms=tr(st.half, jnp.float32)),  # local cos
        plgpu.SMEM((ROWS, st.half), jnp.float32, transforms=tr(st.half, jnp.float32))]  # local sin
    return [
        plgpu.SMEM((consumers, ROWS, st.half), q_dtype, transforms=tr(st.half, q_dtype)),  # q lo, a layer's
        plgpu.SMEM((consumers, ROWS, st.half), q_dtype, transforms=tr(st.half, q_dtype)),  # q hi
        plgpu.SMEM((S, C, st.half), dtype, transforms=tr(st.half)),  # keys lo (rotated in place, or turned)
        plgpu.SMEM((S, C, st.half), dtype, transforms=tr(st.half)),  # keys hi
        plgpu.SMEM((S, C, st.vp), dtype, transforms=tr(st.vp)),  # values, and at the end the output
        *local,
        plgpu.SMEM((S, pipe.chunks, st.half), jnp.float32),  # a step's base cos, a row a chunk
        plgpu.SMEM((S, pipe.chunks, st.half), jnp.float32),  # base sin
        plgpu.SMEM(list_shape, jnp.int32),  # every layer's list
        plgpu.SMEM(word_shape, jnp.int32),  # every refined bitmap
        plgpu.SMEM((count_len,), jnp.int32),  # n_P of each layer
        plgpu.SMEM((consumers, ROWS), jnp.float32),  # lse
    ]


def shared_bytes(scratch) -> int:
    """What `scratch` takes, each buffer aligned to 1024 bytes (the swizzle's), plus the
    barriers: an upper bound on what Mosaic GPU allocates."""
    sizes = [math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in scratch]
    return sum(-(-n // 1024) * 1024 for n in sizes) + 1024


@functools.partial(jax.jit, static_argnames=("launch", "pipe"))
def block_merge_mosaic(q5, layers, selections, launch: BlockLaunch, pipe: Pipeline | None = None, firsts=None,
                       offset=None):
    """`merge.block_merge_pallas` (same arguments and results, no interpret mode:
    `launch.interpret` is refused) on the Mosaic GPU kernel above, laid out as `pipe`
    says (None: `pipeline_for(st)`; `launch.table_rows` is rounded up to `pipe.tile`). `firsts`:
    packed rows, as there: the top layer's walk starts at the step of each block's
    document's first node (`with_firsts`), and `refined_bitmaps` marks the nodes before
    it in that step. `offset`: a context shard's rows, as there. A layout whose buffers pass the
    shared memory a block holds is refused (ValueError) before it is built."""
    if launch.interpret:
        raise ValueError("BlockKernels(merge='mosaic_gpu') has no interpret mode; interpreted runs take 'pallas_triton'")
    st = launch.st
    pipe = pipe or pipeline_for(st)
    B, Tp, H_kv, gp, _ = q5.shape
    dtype, C, S = q5.dtype, pipe.tile, pipe.stages
    table_rows = -(-max(launch.table_rows, 4 * WORD) // C) * C  # a bitmap a TMA copy of at least 16 bytes
    rows, nj, nb = program_rows(st), Tp // st.queries, Tp // st.r
    consumers = rows // ROWS
    words = table_rows // WORD
    list_boxes, word_boxes = tma_boxes(next_power_of_two(st.top_k, 4)), tma_boxes(words)
    L_lists = max(st.num_layers - 1, 1)
    lp = count_entries(st.num_layers, firsts is not None, offset is not None)
    scratch = scratch_shapes(st, pipe, dtype, (L_lists,) + list_boxes, (L_lists,) + word_boxes, lp)
    if shared_bytes(scratch) > LIMIT:
        raise ValueError(f"BlockKernels(merge='mosaic_gpu'): Pipeline(tile={C}, stages={S}) takes {shared_bytes(scratch)} "
                         f"bytes of shared memory at {rows} rows, K / 2 = {st.half}, V = {st.vp} (a block holds "
                         f"{LIMIT}): fewer stages or a smaller tile")
    cos32, sin32 = rope_tables(launch.config, launch.head_dim, table_rows, st)
    turned = pipe.turned
    chunk = C // pipe.chunks  # positions a base angle serves
    tables = [cos32[::chunk], sin32[::chunk]]  # each chunk's first angle
    if not turned:
        tables = [cos32[:ROWS], sin32[:ROWS]] + tables  # each key's angle within its chunk
    T0 = jnp.arange(nb, dtype=jnp.int32) * st.r
    if offset is not None:
        T0 = T0 + offset
    counts = layer_parent_counts(selections, st, T0, (B, nb, H_kv))
    if firsts is not None:
        counts = with_firsts(counts, firsts, st.num_layers)
    if offset is not None:
        counts = with_offset(counts, offset, st.num_layers)
    if selections:
        sel = jnp.stack([s[..., : st.top_k] for s in selections])
        bits = refined_bitmaps(selections, st, words, firsts)
    else:  # a one-layer tree: nothing refined, no list read
        if firsts is not None:
            raise ValueError("BlockKernels(merge='mosaic_gpu'): packed rows of a one-layer tree have no top layer to mark")
        sel = jnp.zeros((1, B, nb, H_kv, st.top_k), jnp.int32)
        bits = jnp.zeros((1, B, nb, H_kv, words), jnp.int32)
    sel, bits = per_program_lists(sel, list_boxes), per_program_lists(bits, word_boxes)
    q_lo, q_hi = rotated_queries(q5, counts, cos32, sin32, st, rows, jnp.float32 if turned else None, offset)
    key_copies = 2 * (C // st.r) + 2
    keys_ready = [plgpu.Barrier(num_arrivals=key_copies, num_barriers=S)] if turned else [
        plgpu.Barrier(num_arrivals=key_copies, num_barriers=S),  # keys and base angles landed
        plgpu.Barrier(num_arrivals=1, num_barriers=S)]  # keys rotated
    bars = [plgpu.Barrier(num_arrivals=3 if turned else 5),  # setup: the lists, the counts, the local tables
            plgpu.Barrier(num_arrivals=2, num_barriers=consumers),  # a consumer's queries
            *keys_ready,
            plgpu.Barrier(num_arrivals=C // st.r, num_barriers=S),  # values landed
            plgpu.Barrier(num_arrivals=consumers, num_barriers=S),  # keys read
            plgpu.Barrier(num_arrivals=consumers, num_barriers=S),  # values read
            plgpu.Barrier(num_arrivals=consumers),  # schedule: the consumers' turns
            plgpu.Barrier(num_arrivals=consumers)]  # finished: every product done
    kernel_fn = functools.partial(_merge_kernel, st=st, consumers=consumers, words=word_boxes, lists=list_boxes,
                                  dtype=dtype, pipe=pipe, packed=firsts is not None, shard=offset is not None)

    def entry(*refs):
        pl.run_scoped(lambda scratch_refs, bar_refs: kernel_fn(*refs, scratch_refs, bar_refs), scratch, bars,
                      collective_axes="wg")

    kernel = plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct((B, nj, H_kv, rows, st.vp), dtype),
                  jax.ShapeDtypeStruct((B, nj, H_kv, rows), jnp.float32)],
        grid=(H_kv, nj, B), grid_names=("h", "j", "b"), num_threads=consumers + 1 + pipe.rotator,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True))
    layers = split_layers(layers, st)
    if turned:
        layers = turned_keys(layers, cos32, sin32, st, C, pipe.absolute_top)
    o, lse = kernel(q_lo, q_hi, *tables, sel, counts, bits, *layers)
    return from_program_layout(o, st, gp), from_program_layout(lse, st, gp)
