#!/bin/bash
cd /work/main
D=docs/benchmarks/cpu-amx-prefetch-session45
P=/work/main/.venv/bin/python
for round in 1 2; do
  for dt in bfloat16 w8a8; do
    echo "== $dt stock round $round $(date +%T)"; $P $D/amx_prefetch.py $dt 2>&1 | grep "verify after"
    C=/tmp/probe-${dt:0:4}t; [ $dt = w8a8 ] && R=256 || R=128
    [ $dt = bfloat16 ] && C=/tmp/probe-bf16t || C=/tmp/probe-w8a8t
    echo "== $dt TILE_ROWS=$R round $round $(date +%T)"; TILE_ROWS=$R MEDUSA_CACHE=$C $P $D/amx_prefetch.py $dt 2>&1 | grep "verify after"
  done
done
echo "== done $(date +%T)"
