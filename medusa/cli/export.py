"""Export Medusa heads or an EAGLE-3 draft for other engines.

    medusa export <heads-dir> <out-dir> --format medusa|vllm [--base BASE] [--base-name NAME] [--dtype fp16]
    medusa export <eagle3-draft> <out-dir> --format speculators|eagle3 [--base BASE] [--base-name NAME] [--dtype bf16]

--format medusa: the official Medusa layout: config.json + medusa_lm_head.safetensors (read by TGI) +
                 medusa_lm_head.pt (the same tensors, for the official medusa-llm package).
--format vllm:   config.json + model.safetensors for vLLM's Medusa drafter. See docs/serving.md.
<heads-dir> may be a native, official or vLLM directory, a Hub id or a shipped set (embedded:<name>). Heads that
share the base lm_head need the base model (--base, else the one their config names) to copy it into every head.
--base-name is what config.json tells the serving engine to load as the base (a Hub id or a path it can reach).
--format speculators: an EAGLE-3 draft (medusa.eagle3) for `vllm serve` and the speculators package, with the target's
                 input embeddings copied in (from --base, else the verifier the draft names).
--format eagle3: the same draft in EAGLE-3's original layout (midlayer.*), what optimum-intel converts for OpenVINO.
<eagle3-draft> may be a directory, a Hub id or the shipped draft (embedded:smollm2-135m-instruct-eagle3).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from medusa.eagle3_io import FORMATS as EAGLE3_FORMATS
from medusa.eagle3_io import export_eagle3, resolve_draft
from medusa.heads_io import FORMATS, export_directory
from medusa.loading import DTYPES


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(
        prog="medusa export",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("heads_dir", help="heads to export: a directory, a Hub id or embedded:<name>")
    parser.add_argument("out_dir", help="directory to write (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--format", required=True, choices=FORMATS + EAGLE3_FORMATS)
    parser.add_argument("--base", help="base model to copy a shared lm_head from (default: the heads' own base)")
    parser.add_argument(
        "--base-name", help="base_model_name_or_path written into config.json (default: --base or the heads' base)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the exported tensors (default: as saved)")
    parser.add_argument("--overwrite", action="store_true", help="replace the layout files in a non-empty out_dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        draft_dir = resolve_draft(args.heads_dir)
    except FileNotFoundError as err:
        parser.exit(1, f"error: {err}\n")
    eagle3 = draft_dir is not None
    if eagle3 != (args.format in EAGLE3_FORMATS):
        what = "an EAGLE-3 draft" if eagle3 else "Medusa heads"
        formats = EAGLE3_FORMATS if eagle3 else FORMATS
        parser.exit(1, f"error: {args.heads_dir} holds {what}: export it with --format {' or '.join(formats)}\n")
    export = export_eagle3 if eagle3 else export_directory
    try:
        out = export(
            draft_dir if eagle3 else args.heads_dir,
            args.out_dir,
            args.format,
            base=args.base,
            base_model_name_or_path=args.base_name,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            overwrite=args.overwrite,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as err:  # named, user-fixable problems: no traceback
        parser.exit(1, f"error: {err}\n")
    print(f"wrote {args.format} layout to {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return out
