"""rows.py with every sdpa call replaced by attention written as multiply-and-sum reductions (what the patch's
`attention.row_invariant_sdpa` does inside the package). Run as rows.py.
"""

import torch
import torch.nn.functional as F

orig = F.scaled_dot_product_attention


def rowinv_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale
    if is_causal:
        M, N = s.shape[-2:]
        attn_mask = torch.ones(M, N, dtype=torch.bool, device=q.device).tril(N - M)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = s.softmax(-1)
    return (p.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)


F.scaled_dot_product_attention = rowinv_sdpa
torch.nn.functional.scaled_dot_product_attention = rowinv_sdpa
exec(open("docs/benchmarks/cpu-w8a8-session32/rows.py").read())
