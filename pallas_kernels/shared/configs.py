"""The kernel families' launch configs, as data (tokamax's way: one small config per
family of kernels, the tuned values kept as data, a heuristic that picks them from the
shapes).

Families, each a frozen dataclass of the values its kernels read:
- `LayerConfig`: the GQA family below the top layer (one query per program): the
  scores, top-K and merge kernels of the forward, the backward's per-query and node
  kernels (`importance.py`, `top_k.py`, `gqa/merge.py`, `gqa/layer_backward.py`,
  `node_backward.py`).
- `TopConfig`: the top layer's merge and importance kernels (`gqa/top_layer.py`: many
  queries per program).
- `TopBackwardConfig`: the top layer's backward (`top_backward.py`).
- `WideConfig`: groups of 32 or more heads, latent attention (`wide/kernels.py`,
  `wide/forward.py`, `wide/backward.py`).
- `BlockConfig`: block selection's merge and backward (`block/merge.py`,
  `block/backward.py`; SPEC 12).
- `DecodeBlockSizes`: the decode kernels (`decode/scores.py`, `decode/merge.py`,
  `decode/kept.py`), what `decode_step` and `prefill` take as `block_sizes`.

`KernelConfigs` holds the full-sequence families; `KernelConfigs.resolve(block_sizes, K,
V)` picks the tuned ones for the head dims (`shape_class`, `TUNED`) and lays a user's
`BlockSizes` over them. `BlockSizes` is what a user may want to set (12 fields, each
`None` for the tuned value); everything else is derived in the kernels from these and
the shapes (pipeline depths that fit shared memory: `shared_memory.py`; chunk sizes:
`gqa/chunks.py`). How each tuned value was found: the journal, "Block sizes: where the
defaults come from" (`benchmarks/journal/`).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.common import KERNEL_GROUP, wide_head_dims

# Entries (query, parent pairs) one node-kernel program walks before the rest of a
# unit's list spills to programs of its own (`node_backward`).
UNIT_ENTRIES = 512


def _check_int(owner: str, name: str, value, least: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{owner}.{name} must be an int >= {least}, got {value!r}")


def _check_warps(owner: str, name: str, warps) -> None:
    if not isinstance(warps, int) or warps < 1 or warps & (warps - 1) or warps > 32:
        raise ValueError(f"{owner}.{name} must be a power of two from 1 to 32 (warps), got {warps!r}")


def _check_fields(config, warps: tuple = (), least_zero: tuple = ()) -> None:
    owner = type(config).__name__
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in warps:
            _check_warps(owner, field.name, value)
        elif field.type in ("int", int):
            _check_int(owner, field.name, value, 0 if field.name in least_zero else 1)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The GQA family below the top layer: one query per program."""

    span: int = 64  # candidates per score product (the keys are kept in span/r rotated copies)
    tile: int = 64  # candidates per inner step
    min_query_rows: int = 8  # a query's G heads padded to at least this many rows (8 or 16)
    num_warps: int = 2  # the scores kernel's and the backward's per-query kernels'
    merge_num_warps: int = 2  # the merges that gather keys (the bottom's)
    scored_merge_num_warps: int = 4  # merges of stored scores (no key gathers)
    select_num_warps: int = 4  # the shared top-K kernel (every layer, the top's included)
    num_stages: int = 2  # the backward's per-query kernels
    scores_num_stages: int = 3  # the forward's scores kernel
    merge_num_stages: int = 3  # the forward's merges
    node_entries: int = UNIT_ENTRIES  # 0: never spill
    node_num_warps: int = 4  # the backward's node kernel

    def __post_init__(self):
        if self.min_query_rows not in (8, 16):
            raise ValueError(f"LayerConfig.min_query_rows must be 8 or 16, got {self.min_query_rows!r}")
        _check_fields(self, warps=("num_warps", "merge_num_warps", "scored_merge_num_warps", "select_num_warps",
                                   "node_num_warps"), least_zero=("node_entries",))


@dataclasses.dataclass(frozen=True)
class TopConfig:
    """The top layer's forward kernels: `rows` query rows (queries x heads) per program."""

    rows: int = 128  # 256 overflow shared memory
    tile: int = 64  # the merge's candidates per step
    num_warps: int = 8
    num_stages: int = 3
    keys_tile: int = 128  # the importance kernel's candidates per step
    keys_stages: int = 2

    def __post_init__(self):
        _check_fields(self, warps=("num_warps",))


@dataclasses.dataclass(frozen=True)
class TopBackwardConfig:
    """The top layer's backward: its dq kernel's query rows per program, nodes per step,
    warps, stages; its node kernel's (dk, dv) nodes per program, query rows per step,
    warps, stages, and about how many programs share a chunk's work (each tile's
    queries split among several: `top_backward.top_backward_statics`)."""

    dq_rows: int = 64
    dq_tile: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    dkv_tile: int = 64
    dkv_rows: int = 64
    dkv_warps: int = 4
    dkv_stages: int = 2
    dkv_programs: int = 4096

    def __post_init__(self):
        _check_fields(self, warps=("dq_warps", "dkv_warps"))


@dataclasses.dataclass(frozen=True)
class WideConfig:
    """Groups of `KERNEL_GROUP * 2` or more heads (latent attention): heads per program
    (one gathered key row feeds them all; 0 runs such groups as virtual kv heads of 16
    instead), candidates per step, launch; the backward's heads per program and warps.
    Float32 inputs take one stage everywhere (tiles twice the bytes)."""

    rows: int = 64
    tile: int = 64
    num_warps: int = 8
    num_stages: int = 2  # the merges gain from a second stage
    importance_stages: int = 1  # the importance's tiles do not fit two
    backward_rows: int = 64
    backward_num_warps: int = 8

    def __post_init__(self):
        if not isinstance(self.rows, int) or self.rows < 0 or (self.rows and self.rows < KERNEL_GROUP):
            raise ValueError(f"WideConfig.rows must be 0 (off) or an int >= {KERNEL_GROUP}, got {self.rows!r}")
        _check_fields(self, warps=("num_warps", "backward_num_warps"), least_zero=("rows",))
        if self.backward_rows < KERNEL_GROUP:
            raise ValueError(f"WideConfig.backward_rows must be >= {KERNEL_GROUP}, got {self.backward_rows!r}")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Block selection's family (SPEC 12, `pallas_kernels/block/`): a program per `(block,
    kv head)` holds the block's `b * G` rows. The merge's candidates a step (a multiple of
    `r`, two node tiles at r = 16) and warps, and the backward's; which kernel runs each
    part is the call's `shared.kernels.BlockKernels`, not a config. The Mosaic GPU merge
    steps its own 64 or 128 candidates (`block/mosaic_merge.pipeline_for`)."""

    merge_tile: int = 32
    merge_num_warps: int = 4
    backward_tile: int = 32  # the backward holds five [rows, tile] float32 arrays
    backward_num_warps: int = 8
    # With partial sums: the blocks go in chunks whose partial buffer stays under this
    # many bytes (temporaries of the backward; at 128K, 16 GiB is 512 blocks a chunk of
    # 8192 on the Mosaic GPU walk's 16-bit slabs; fewer, larger chunks are faster: the
    # Pallas-Triton walk took 681 ms at 16 GiB against 795 at 4).
    backward_partial_bytes: int = 1 << 34
    # The partial sums' launch (`partials.sum_partials`, Pallas-Triton): warps and the
    # pipeline stages of its loop over a tile's entries (each entry's loads depend on the
    # index's, so one stage waits on each; more might overlap them). Timed apart at 128K
    # (`python -m benchmarks.profile --pass block-backward --sum-variants 8:1,8:2,4:3`,
    # H100, RESULTS): 8:1 43.1 ms, 8:2 43.2, 4:3 47.7; the default stays 8:1.
    backward_sum_num_warps: int = 8
    backward_sum_num_stages: int = 1

    def __post_init__(self):
        _check_fields(self, warps=("merge_num_warps", "backward_num_warps", "backward_sum_num_warps"))


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """The decode family's config (`decode/scores.py`, `decode/merge.py`): what `decode_step` and `prefill`
    take as `block_sizes`."""

    # Candidates per score product (one query rotation); raised to >= 16 and >= r.
    span: int = 64
    # Programs to aim for per launch: a query's candidates are split until
    # B * Q * H_kv * splits reaches this (at most Mp / span splits). Wide programs (64
    # heads each, one per multiprocessor) aim for about one wave: more splits ran the MLA
    # step slower (every split loads the queries and writes a partial state; journal,
    # 2026-11-25 (5)).
    target_programs: int = 512
    wide_target_programs: int = 128
    num_warps: int = 4
    # Scores and packed keys of a chunk of queries (prefill) stay under this.
    chunk_budget_bytes: int = 256 << 20
    # Groups over 16 heads (latent attention's 64-128 over one latent key): heads per
    # program (`common.head_block`: the largest power of two up to this dividing G), every
    # gathered key row feeding them all; 16: the 16-head virtual groups of the
    # full-sequence kernels. Those programs' warps: `wide_num_warps`.
    wide_rows: int = 64
    wide_num_warps: int = 8
    # Block selection's one-launch step inside a block (`decode/kept.py`): pipeline stages
    # of its candidate loop.
    kept_num_stages: int = 1

    def __post_init__(self):
        rows = self.wide_rows
        if not isinstance(rows, int) or rows < KERNEL_GROUP or rows & (rows - 1):
            raise ValueError(f"DecodeBlockSizes.wide_rows must be a power of two >= {KERNEL_GROUP}, got {rows!r}")
        for name in ("target_programs", "wide_target_programs", "kept_num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeBlockSizes.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """What a user may set of the Pallas forward's and backward's tiling (they share it).

    Pass one to `htree_attention(..., block_sizes=...)` (or the modules) to tune. Every
    field `None` (the default) takes the tuned value for the head dims
    (`KernelConfigs.resolve`); a field set replaces it in its family:
    - `span`, `tile`, `min_query_rows`, `num_warps` (scores and merges), `num_stages`
      (every per-query kernel's pipeline depth; a depth whose tiles do not fit shared
      memory takes one stage), `node_entries` (the backward's node kernel; 0 never
      spills): the layers below the top (`LayerConfig`);
    - `top_rows` (query rows per program), `top_tile` (the merge's nodes per step):
      the top layer (`TopConfig`);
    - `wide_rows` (heads per program, 0 runs such groups as virtual kv heads of 16),
      `wide_backward_rows`: groups of 32 or more heads (`WideConfig`);
    - `save_selections`: the backward reads the forward's selections (`(L-1) *
      B*T*H_kv*top_k` int32 kept) instead of selecting again (8-10% faster fwd+bwd);
    - `chunk_budget_bytes`: the per-chunk buffers' budget (fewer, larger chunks launch
      less).
    A full `KernelConfigs` may be passed instead, for tuning every value."""

    span: int | None = None
    tile: int | None = None
    min_query_rows: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    node_entries: int | None = None
    top_rows: int | None = None
    top_tile: int | None = None
    wide_rows: int | None = None
    wide_backward_rows: int | None = None
    save_selections: bool | None = None
    chunk_budget_bytes: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.name == "save_selections":
                if not isinstance(value, bool):
                    raise ValueError(f"BlockSizes.save_selections must be a bool, got {value!r}")
            elif field.name == "num_warps":
                _check_warps("BlockSizes", field.name, value)
            elif field.name == "min_query_rows":
                if value not in (8, 16):
                    raise ValueError(f"BlockSizes.min_query_rows must be 8 or 16, got {value!r}")
            else:
                least = 0 if field.name in ("node_entries", "wide_rows") else 1
                hint = " (0: never spill)" if field.name == "node_entries" else ""
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    raise ValueError(f"BlockSizes.{field.name} must be an int >= {least}{hint}, got {value!r}")
        if self.wide_rows and self.wide_rows < KERNEL_GROUP:
            raise ValueError(f"BlockSizes.wide_rows must be 0 (off) or >= {KERNEL_GROUP}, got {self.wide_rows!r}")
        if self.wide_backward_rows is not None and self.wide_backward_rows < KERNEL_GROUP:
            raise ValueError(f"BlockSizes.wide_backward_rows must be >= {KERNEL_GROUP}, "
                             f"got {self.wide_backward_rows!r}")


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
    """Every full-sequence family's config: what the kernels read."""

    layer: LayerConfig = LayerConfig()
    top: TopConfig = TopConfig()
    top_backward: TopBackwardConfig = TopBackwardConfig()
    wide: WideConfig = WideConfig()
    block: BlockConfig = BlockConfig()
    save_selections: bool = True
    chunk_budget_bytes: int = 2 << 30

    @classmethod
    def resolve(cls, block_sizes: "BlockSizes | KernelConfigs | None", K: int, V: int) -> "KernelConfigs":
        """The tuned configs for head dims `K`, `V` (`TUNED[shape_class(K, V)]`) with the
        fields `block_sizes` sets laid over them; a `KernelConfigs` is taken as it is."""
        if isinstance(block_sizes, KernelConfigs):
            return block_sizes
        tuned = TUNED[shape_class(K, V)]
        if block_sizes is None:
            return tuned
        if not isinstance(block_sizes, BlockSizes):
            raise TypeError(f"block_sizes must be an htree_jax.BlockSizes (or None), got {type(block_sizes).__name__}")
        given = {f.name: getattr(block_sizes, f.name) for f in dataclasses.fields(BlockSizes)
                 if getattr(block_sizes, f.name) is not None}
        changes = {}
        for name, value in given.items():
            for target in USER_FIELDS[name]:
                changes[target] = value
        return tuned.with_changes(changes)

    def with_changes(self, changes: dict) -> "KernelConfigs":
        """A copy with `{"family.field": value}` (or a field of this class) changed: how
        sweeps and profilers try candidates."""
        families = {}
        top_level = {}
        for name, value in changes.items():
            family, _, field = name.rpartition(".")
            if not family:
                if name not in {f.name for f in dataclasses.fields(self)} - set(FAMILIES):
                    raise ValueError(f"{name!r} is not a KernelConfigs field")
                top_level[name] = value
                continue
            if family not in FAMILIES:
                raise ValueError(f"{name!r}: no kernel family {family!r} ({', '.join(FAMILIES)})")
            families.setdefault(family, {})[field] = value
        replaced = {family: dataclasses.replace(getattr(self, family), **fields) for family, fields in families.items()}
        return dataclasses.replace(self, **replaced, **top_level)


# The families' fields of `KernelConfigs` (`with_changes` takes "family.field").
FAMILIES = ("layer", "top", "top_backward", "wide", "block")

# Where each `BlockSizes` field lands.
USER_FIELDS = {
    "span": ("layer.span",),
    "tile": ("layer.tile",),
    "min_query_rows": ("layer.min_query_rows",),
    "num_warps": ("layer.num_warps", "layer.merge_num_warps"),
    "num_stages": ("layer.num_stages", "layer.scores_num_stages", "layer.merge_num_stages"),
    "node_entries": ("layer.node_entries",),
    "top_rows": ("top.rows",),
    "top_tile": ("top.tile",),
    "wide_rows": ("wide.rows",),
    "wide_backward_rows": ("wide.backward_rows",),
    "save_selections": ("save_selections",),
    "chunk_budget_bytes": ("chunk_budget_bytes",),
}


def shape_class(K: int, V: int) -> str:
    """The heuristic that picks a tuned entry: heads up to 256 features (padded), or wider
    ones (latent attention, K = 576, V = 512)."""
    return "wide" if wide_head_dims(K, V) else "head_dims<=256"


# The tuned configs per shape class, as data. Each value is the fastest of a GPU sweep
# at the class's benchmark shape (bf16; H=32, H_kv=4, K=V=128, T=131072; MLA: 128 heads
# over one latent head, K=576, V=512); the sweeps are in the journal.
TUNED = {
    # Defaults of the dataclasses above. Below the top: 8 rows ran faster than 16, 2
    # warps keep such products busiest, 3 stages were the fastest forward depth
    # (2026-11-27 (1)), the node kernel 4 warps; the top layer: 128 rows (256
    # overflow), its importance 128 candidates in 2 stages (2026-11-26); its backward
    # splits each tile's queries among programs (more rows per dq program ran slower).
    # Block selection (H200, T=131072, `top_k=512`, 2026-11-29; RESULTS, "Block
    # selection's kernels"): the merge 32 candidates x 4 warps 123.8 ms (32 x 8 167.8,
    # 16 x 4 170.9, 64 x 4 155.2, 64 x 8 144.9); the backward 32 x 8 879.1 ms (32 x 4
    # 1529.7, 16 x 4 1436.3, 64 x 8 1011.4).
    "head_dims<=256": KernelConfigs(),
    # 32-candidate tiles below the top and 16 on the top layer: the fastest that fit
    # (64-candidate tiles overflow shared memory at 576 features), 4 warps; the wide
    # family's 64 heads per program, 64 candidates, 8 warps (2026-11-25 (2), (3)).
    "wide": KernelConfigs(
        layer=LayerConfig(span=32, tile=32, num_warps=4, merge_num_warps=4),
        top=TopConfig(rows=16, tile=16, num_warps=4, keys_tile=16),
        top_backward=TopBackwardConfig(dq_rows=16, dq_tile=16, dkv_tile=16, dkv_rows=16)),
}


__all__ = ["BlockConfig", "BlockSizes", "DecodeBlockSizes", "FAMILIES", "KernelConfigs", "LayerConfig", "TUNED",
           "TopBackwardConfig", "TopConfig", "UNIT_ENTRIES", "WideConfig", "shape_class"]
