"""Every proposer by name: what `generate(proposer=...)` and the plan (medusa.plan) choose from.

The registry sits above the modules that define proposers, since they import medusa.propose (Candidates) themselves.
"""

from __future__ import annotations

from medusa.dynamic_tree import build_dynamic_proposer
from medusa.prompt_lookup import build_hybrid_proposer, build_prompt_lookup_proposer
from medusa.propose import PlainProposer, build_medusa_proposer

# name -> builder(model: MedusaModel, tree: TreeBuffers on the model's device) -> Proposer
PROPOSERS = {
    "medusa": build_medusa_proposer,
    "plain": lambda model, tree: PlainProposer(model.device),
    "dynamic": build_dynamic_proposer,
    "prompt_lookup": build_prompt_lookup_proposer,
    "hybrid": build_hybrid_proposer,
}


def get_proposer(name: str):
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}: use one of {sorted(PROPOSERS)}")
    return PROPOSERS[name]
