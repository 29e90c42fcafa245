"""rows_reduction_attention.py with the target left on transformers' sdpa (so the engines' copies attend through
`shared_gqa_sdpa`, whose sdpa calls the reduction replaces): the configuration whose package came out row-invariant.
Apply w8a8.patch first; run as rows.py.
"""

import medusa.runtime.quantize as QQ

QQ.use_row_invariant_sdpa = lambda model: None  # attend through shared_gqa_sdpa, as the first probe did
exec(open("docs/benchmarks/cpu-w8a8-session32/rows_reduction_attention.py").read())
