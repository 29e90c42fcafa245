"""One line per `medusa bench` output directory: tokens/s of transformers (baseline), our plain decoding
(baseline_compiled) and planned, planned / plain, target forwards plain / planned, identical shares."""

import json
import sys

for directory in sys.argv[1:]:
    overall = json.load(open(f"{directory}/summary.json"))["overall"]
    hf, plain, planned = (overall[m] for m in ("baseline", "baseline_compiled", "planned"))
    print(
        f"{directory}: transformers {hf['tokens_per_s']:.2f} plain {plain['tokens_per_s']:.2f} "
        f"planned {planned['tokens_per_s']:.2f} ratio {planned['tokens_per_s'] / plain['tokens_per_s']:.3f} "
        f"forwards {plain['forwards']:.0f}/{planned['forwards']:.0f} "
        f"identical {planned['identical_share']:.2f}/{planned['identical_share_vs_compiled']:.2f}"
    )
