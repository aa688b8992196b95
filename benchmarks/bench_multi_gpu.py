"""The sharded paths on several real GPUs (issue 22): batch sharding's scaling and
context parallelism, through the public `htree_attention` under `jax.jit` with
`NamedSharding` inputs (the custom-partitioned forward and backward,
`htree_jax/sharding.py`).

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_multi_gpu.py [--T 131072] [--top-k 512,64]
        [--cp-T 1048576,2097152] [--iters 3]

- Batch: forward + backward (gradient of a float32 sum), bf16, H=32, H_kv=4, K=V=128,
  B = N rows sharded one per GPU, against B = 1 on one GPU (the unsharded call): scaling
  efficiency = time on 1 GPU / time on N; dense cuDNN the same way.
- Context parallelism (`--cp-top-k`, 64; `--cp-selection-block 16`: block selection): T sharded over n of the GPUs (`--cp-devices`,
  default 1 and all), forward + backward, each (T, n) in a process of its own: its time,
  XLA's planned peak per device (the compiled step's, checked against free memory before
  it runs: `compile_checked`) and every device's measured peak (`memory_stats`).
- Out of memory on purpose (`--oom-T`): the checked call and the unchecked one (with
  XLA's rendezvous limit `--xla_gpu_nccl_termination_timeout_seconds`): how they end.
- The compiled HLO of each sharded run: collectives, and whether any all-gather carries
  q's shard (it must not).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import attend
from htree_jax.bench import dense_fn, gpu_header, grad_of_sum, int_list, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.memory import MemoryPlan, compile_checked

H, H_KV, K, V = 32, 4, 128, 128


def drawn_inputs(B: int, T: int, sharding, seed: int = 0):
    """`(q, k, v)` `[B, T, H or H_kv, K or V]` bf16 normals, each shard drawn on its own device
    (`sharding`): nothing whole is held on one device first (drawing 4M tokens' q on
    the host took more than 150 s). The draw's random bits are freed before a step runs
    and take less than it does, so they do not set a device's peak."""
    keys = jax.random.split(jax.random.key(seed), 3)
    draw = lambda key, h, d: jax.random.normal(key, (B, T, h, d), jnp.bfloat16)
    return [jax.jit(draw, static_argnums=(1, 2), out_shardings=sharding)(key, h, d)
            for key, h, d in zip(keys, (H, H_KV, H_KV), (K, K, V))]


def compiled_text(fn, args) -> str:
    """The compiled program of `fn(*args)` (`fn` jitted, or already compiled)."""
    return (fn if hasattr(fn, "as_text") else fn.lower(*args).compile()).as_text()


def collectives(text: str) -> str:
    """A compiled program's collective ops, counted."""
    counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in
              ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")}
    return ", ".join(f"{op} {n}" for op, n in counts.items() if n) or "none"


def q_gathered(text: str, q_local_shape) -> bool:
    """Whether an all-gather of the compiled program has q's per-device shape."""
    dims = ",".join(map(str, q_local_shape))
    return any(f"[{dims}]" in line for line in text.splitlines() if "all-gather" in line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", default="512,64")
    p.add_argument("--cp-T", default="1048576,2097152")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--skip-batch", action="store_true", help="context parallelism only")
    p.add_argument("--single-max-T", type=int, default=2097152, help="the longest T also run on one GPU")
    p.add_argument("--cp-devices", default="", help="device counts of the context-parallel runs (default 1 and all)")
    p.add_argument("--cp-top-k", type=int, default=64)
    p.add_argument("--cp-selection-block", type=int, default=1,
                   help="HTreeConfig.selection_block of the context-parallel runs: 1 (per query, as RESULTS' rows "
                        "were measured) or 16 (block selection, the library's default)")
    p.add_argument("--oom-T", type=int, default=0, help="a T past the plan: the out-of-memory runs (0: none)")
    p.add_argument("--nccl-timeout", type=int, default=30, help="the unchecked run's rendezvous limit, seconds")
    p.add_argument("--child-timeout", type=float, default=420, help="seconds before a child process is killed")
    p.add_argument("--backend", default="pallas", help="pallas_interpret: a CPU smoke test of the script")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--oom", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return one_run(args)
    if args.oom:
        return oom_run(args)
    N = jax.device_count()
    setting = f"{N} x {jax.devices()[0].device_kind}, H={H} H_kv={H_KV} K=V={K} bf16 random"
    command = f"python benchmarks/bench_multi_gpu.py {' '.join(sys.argv[1:] if argv is None else argv)}"
    print(gpu_header("multi-GPU", setting, command) if args.backend == "pallas" else f"# smoke test: {setting}")
    mesh = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,))
    dev0 = jax.devices()[0]

    if not args.skip_batch:
        batch_scaling(args, mesh, dev0, N)
    if args.cp_T:
        context_parallel(args, N)
    if args.oom_T:
        out_of_memory(args, N)
    return 0


def batch_scaling(args, mesh, dev0, N: int) -> None:
    print(f"\n## Batch sharding: B={N} on {N} GPUs vs B=1 on one, T={args.T}, forward + backward")
    print("| attention | top_k | 1 GPU B=1 ms | N GPUs B=N ms | efficiency | collectives | q all-gathered |")
    print("|---|---|---|---|---|---|---|")
    one = drawn_inputs(1, args.T, jax.sharding.SingleDeviceSharding(dev0))
    many = drawn_inputs(N, args.T, NamedSharding(mesh, P("x")), seed=1)
    for top_k in int_list(args.top_k):
        config = HTreeConfig(top_k=top_k, selection_block=1)
        single = jax.jit(grad_of_sum(lambda q, k, v, c=config: attend(q, k, v, c, "pallas", None)[0]))
        sharded = jax.jit(grad_of_sum(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas")))
        t1, tn = median_ms(single, one, args.iters), median_ms(sharded, many, args.iters)
        text = compiled_text(sharded, many)
        print(f"| htree | {top_k} | {t1:.1f} | {tn:.1f} | {t1 / tn:.3f} | {collectives(text)} | "
              f"{q_gathered(text, (1, args.T, H, K))} |", flush=True)
    dense = jax.jit(grad_of_sum(dense_fn(HTreeConfig())))
    t1, tn = median_ms(dense, one, args.iters), median_ms(dense, many, args.iters)
    print(f"| dense cuDNN | - | {t1:.1f} | {tn:.1f} | {t1 / tn:.3f} | {collectives(compiled_text(dense, many))} | - |",
          flush=True)
    del one, many


def context_parallel(args, N: int) -> None:
    """Each (T, device count) in a process of its own, so each device's peak is that
    run's alone (a device's peak counter never falls, and an earlier run's buffers stay
    cached)."""
    counts = int_list(args.cp_devices) if args.cp_devices else [1, N]
    print(f"\n## Context parallelism: T sharded over n GPUs, top_k={args.cp_top_k}, "
          f"selection_block={args.cp_selection_block}, forward + backward")
    print("| T | GPUs | ms | speed-up vs 1 GPU | planned peak GiB per device | measured peak GiB per device | "
          "collectives | q all-gathered |")
    print("|---|---|---|---|---|---|---|---|")
    for T in int_list(args.cp_T):
        one = None
        for n in counts:
            if n == 1 and T > args.single_max_T:
                continue
            res = run_child(["--one", f"{T},{n}"] + common_flags(args), timeout=args.child_timeout)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = " ".join((res.stdout + res.stderr).strip().splitlines()[-3:])[-300:]
                print(f"| {T} | {n} | failed (exit {res.returncode}): {tail} | | | | | |", flush=True)
                continue
            ms, planned, peaks, coll, gathered = line.split(" ", 1)[1].split("|")
            ms = float(ms)
            one = ms if n == 1 else one
            ratio = f"{one / ms:.3f}" if one is not None else "-"
            print(f"| {T} | {n} | {ms:.1f} | {ratio} | {planned} | {peaks} | {coll} | {gathered} |", flush=True)


def common_flags(args) -> list[str]:
    return ["--iters", str(args.iters), "--cp-top-k", str(args.cp_top_k), "--cp-selection-block",
            str(args.cp_selection_block), "--backend", args.backend]


def run_child(flags, timeout: float, env=None) -> subprocess.CompletedProcess:
    """This script with `flags` in a new process (killed after `timeout` s: its
    `returncode` is then None)."""
    try:
        return subprocess.run([sys.executable, __file__] + flags, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(e.cmd, None, out, err)


def sharded_inputs(T: int, n: int):
    """`(q, k, v)` on the first `n` devices, T sharded over them (n = 1: on device 0)."""
    if n == 1:
        return drawn_inputs(1, T, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    return drawn_inputs(1, T, NamedSharding(mesh, P(None, "x")))


def cp_step(args, T: int, n: int):
    """`(step, (q, k, v))`: the forward + backward of `htree_attention` (a float32 sum's
    gradient) and its inputs sharded along T over the first `n` devices."""
    config = HTreeConfig(top_k=args.cp_top_k, selection_block=args.cp_selection_block)
    return grad_of_sum(lambda q, k, v: htree_attention(q, k, v, config, backend=args.backend)), sharded_inputs(T, n)


def one_run(args) -> int:
    """`--one T,n`: the forward + backward compiled with its plan checked
    (`compile_checked`), timed, each device's measured peak beside the plan."""
    T, n = int_list(args.one)
    step, xs = cp_step(args, T, n)
    compiled = compile_checked(step, *xs, what=f"htree fwd+bwd at T={T} over {n}")
    # The peak of one call (read before timing: back-to-back calls hold two outputs).
    jax.block_until_ready(compiled(*xs))
    peaks = ", ".join(f"{(d.memory_stats() or {}).get('peak_bytes_in_use', 0) / 2**30:.1f}" for d in jax.devices()[:n])
    ms = median_ms(compiled, xs, args.iters)
    text = compiled_text(compiled, xs)
    print(f"RESULT {ms:.3f}|{MemoryPlan.of(compiled).peak / 2**30:.2f}|{peaks}|{collectives(text)}|"
          f"{q_gathered(text, (1, T // n, H, K))}", flush=True)
    return 0


def out_of_memory(args, N: int) -> None:
    """A T past the plan over every device, twice, each in its own process: checked
    (`compile_checked`: a `MemoryError` on the host before any kernel runs) and unchecked
    (run as is, with `--xla_gpu_nccl_termination_timeout_seconds`, XLA's limit on the
    wait in a collective's rendezvous): how long until the call ends, and how."""
    print(f"\n## Out of memory on purpose: T={args.oom_T} over {N} GPUs, forward + backward")
    print("| run | ended after s | exit | how it ended |\n|---|---|---|---|")
    for mode in ("checked", "unchecked"):
        env = dict(os.environ)
        if mode == "unchecked":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_gpu_nccl_termination_timeout_seconds="
                                f"{args.nccl_timeout}")
        t0 = time.perf_counter()
        res = run_child(["--oom", f"{args.oom_T},{N}", mode] + common_flags(args), timeout=args.child_timeout,
                        env=env)
        lines = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
        said = next((x for x in lines if x.startswith("ENDED ")), None)
        what = said[6:] if said else " / ".join(x.strip() for x in lines[-2:])
        print(f"| {mode} | {time.perf_counter() - t0:.1f} | {res.returncode} | {what[:400]} |", flush=True)


def oom_run(args) -> int:
    """`--oom T,n checked|unchecked`: see `out_of_memory`. Prints the time from the
    call to its error (after compiling) and the error's first line."""
    (T, n), mode = int_list(args.oom[0]), args.oom[1]
    step, xs = cp_step(args, T, n)
    t0 = time.perf_counter()
    try:
        if mode == "checked":
            compiled = compile_checked(step, *xs, what=f"htree fwd+bwd at T={T} over {n}")
        else:
            compiled = jax.jit(step).lower(*xs).compile()
        t1 = time.perf_counter()
        jax.block_until_ready(compiled(*xs))
        print(f"ENDED ran (compiled in {t1 - t0:.1f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - the error is the measurement
        t2 = time.perf_counter()
        print(f"ENDED {type(e).__name__} {t2 - t0:.1f} s after the call: {str(e).splitlines()[0][:300]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
