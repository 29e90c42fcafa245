"""`medusa accuracy` (medusa/cli/accuracy.py, where its options are described), kept for older command lines.

    python scripts/head_accuracy.py --questions ../shared/bench_data/spec_bench_question.jsonl --limit 80 \\
        --out runs/acc.json
"""

from medusa.cli.accuracy import main

if __name__ == "__main__":
    main()
