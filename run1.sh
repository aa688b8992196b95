export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout 80 python benchmarks/bench_block_routes.py --time --routes=mosaic_gpu --T=131072 --kinds=random,correlated 2>&1 | grep -E "TIMING|Error|FAIL" | cut -c1-700
timeout 110 python benchmarks/bench_block_routes.py --time --routes=mosaic_gpu --T=524288 --kinds=random 2>&1 | grep -E "TIMING|Error|FAIL" | cut -c1-700
timeout 400 python tools/gpu_gate.py --big-T 0 --only 'block(?!.*via triton)' --workers 16 2>&1 | tail -60
