#!/usr/bin/env bash
# Two rounds, the two sides alternated: bash docs/benchmarks/cpu-zen4-session68/ab/ab.sh OUT   (~15 min once planned)
set -eu
for round in 1 2; do
  for side in onednn template; do
    python "$(dirname "$0")/ab.py" "$side" "${1:?usage: ab.sh OUT}/$side-$round"
  done
done
