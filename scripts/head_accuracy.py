"""`medusa accuracy` (medusa/cli/accuracy.py, where its options are described), kept for older command lines.

    python scripts/head_accuracy.py --questions ../shared/bench_data/spec_bench_question.jsonl --limit 80 \\
        --out runs/acc.json
"""

import runpy
import sys

if __name__ == "__main__":
    sys.argv = ["medusa", "accuracy", *sys.argv[1:]]
    runpy.run_module("medusa", run_name="__main__")  # the `medusa` command, as `python -m medusa accuracy`
