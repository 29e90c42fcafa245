"""MedusaModel: holds a base causal LM (any `AutoModelForCausalLM`) and its heads; loads, saves and generates."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from medusa.config import CONFIG_NAME, MedusaConfig
from medusa.custom_generate import write_hook
from medusa.decode import BatchLayout, SpeculativeGenerator
from medusa.draft import DraftModel
from medusa.eagle3 import COPY_NGRAM, Eagle3Draft, Eagle3Model
from medusa.eagle3_io import load_eagle3, resolve_draft
from medusa.fileio import write_directory
from medusa.hardware import native_bf16
from medusa.heads import MedusaHeads
from medusa.heads_io import (
    CARD_NAME,
    adapter_files,
    has_adapter,
    load_heads,
    merge_adapter,
    model_card,
    resolve_heads,
    save_heads,
)
from medusa.hub import EMBEDDED_HEADS_ROOT, push_to_hub
from medusa.loading import DEFAULT_BASE, BaseSource, resolve_dtype
from medusa.plan import (
    ObservedAcceptance,
    Plan,
    Planned,
    batch_choice,
    lay_out,
    load_accuracy,
    load_draft_taus,
    save_accuracy,
)
from medusa.precision import load_target
from medusa.propose import CandidateProjection, compile_proposal
from medusa.proposers import get_proposer
from medusa.runtime import int8_copy, releases_openmp_pool
from medusa.sampling import SamplingConfig
from medusa.tree import TreeSpec, build_buffers, chain, load_tree

logger = logging.getLogger(__name__)

DEFAULT_HEADS_DIR = EMBEDDED_HEADS_ROOT / "smollm2-135m-instruct"
# How many of a vocabulary subset's most frequent candidates the heads rank on a CPU, where the projection is the
# largest part of proposing: half of the shipped 8,192 kept tau (training prompts, docs/engines.md, session 35).
CPU_CANDIDATES = 4096


def _default_tree(num_heads: int) -> list[list[int]]:
    """A small sparse tree for untrained or tree-less heads: a chain plus top-2/3 alternatives near the root."""
    paths = chain(num_heads) + [[1], [2], [0, 1], [1, 0]]
    return TreeSpec([p for p in paths if len(p) <= num_heads], num_heads=num_heads).to_list()


class MedusaModel(Planned, SpeculativeGenerator, nn.Module):
    """`base` is any causal LM; `heads` read its last hidden state. The base is held, never subclassed."""

    def __init__(
        self,
        base,
        heads: MedusaHeads,
        tokenizer=None,
        tree: list[list[int]] | None = None,
        projection_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        config = heads.config
        lm_head = base.get_output_embeddings()
        hidden, vocab = base.config.get_text_config().hidden_size, lm_head.weight.shape[0]
        if config.hidden_size != hidden:
            raise ValueError(
                f"heads were trained for hidden size {config.hidden_size} but the base model has {hidden}: "
                f"load the heads with the base they were trained on ({config.base_model_name_or_path})"
            )
        if config.vocab_size != vocab:
            raise ValueError(
                f"heads project to a vocabulary of {config.vocab_size} but the base model's has {vocab}: "
                f"load the heads with the base they were trained on ({config.base_model_name_or_path})"
            )
        layers = base.config.get_text_config().num_hidden_layers
        if any(layer >= layers for layer in config.feature_layers):
            raise ValueError(
                f"heads read the base's layers {config.feature_layers} (feature_layers) but the base model has "
                f"{layers} "
                f"layers: load the heads with the base they were trained on ({config.base_model_name_or_path})"
            )
        self.base, self.heads, self.tokenizer = base, heads.to(device=base.device, dtype=base.dtype), tokenizer
        self.tree = tree or config.tree or _default_tree(config.num_heads)
        TreeSpec(self.tree, num_heads=config.num_heads)
        self.projection_dtype = projection_dtype or _candidate_dtype(base)
        self.refresh_candidate_projection()
        self.accuracy: list[list[float]] | None = None  # acc_given_prefix per head and rank (medusa.plan)
        self.decoded_taus: dict | None = None  # each option's tokens per step on held-out prompts (medusa.plan)
        self.plan: Plan | None = None  # what generate uses by default (medusa.plan); None: eager, the heads' tree
        self.acceptance = ObservedAcceptance()  # what batches decoded together accepted of their trees' expected tau
        self.engine_override: str | None = None  # from_pretrained(engine=...): wins over the plan
        # False for from_base's heads: they guess nothing yet, so generate guesses with prompt lookup instead
        self.heads_trained = True
        self.adapter: dict[str, bytes] | None = None  # Medusa-2: the adapter files loaded, saved again with the heads

    @property
    def default_proposer(self) -> str:
        """What guesses when neither the call nor the plan names a proposer: the heads, or prompt lookup (which needs
        no training) where they are untrained."""
        return "medusa" if self.heads_trained else "prompt_lookup"

    @property
    def best_plain_engine(self) -> str:
        """The engine of the best plain decoding at hand: the plan's fastest measured, else the compiled engine."""
        return self.plan.plain_engine if self.plan is not None else "compiled"

    def refresh_candidate_projection(self) -> None:
        """Rebuild what proposing uses (after changing the heads' weights, vocabulary subset or device): the
        projection, and the heads it runs. On a CPU both compute on int8 weights (medusa.runtime.int8_copy: 14 small
        GEMMs a step of the dynamic tree read a quarter of the bytes; the target verifies every guess exactly), and
        the projection ranks the CPU_CANDIDATES most frequent candidates of a vocabulary subset."""
        int8 = self.base.device.type == "cpu" and self.base.dtype in (torch.float32, torch.bfloat16)
        self.candidate_projection = CandidateProjection.build(
            self.heads,
            self.base.get_output_embeddings(),
            self.projection_dtype,
            int8=int8,
            most_frequent=CPU_CANDIDATES if int8 else None,
        )
        self.proposal_heads = int8_copy(self.heads, skip=("projections",)) if int8 else self.heads
        # what proposes compiled ahead of time (medusa.propose.compile_proposal), made when a call first runs on an
        # engine that compiles ahead of time (`make_proposer`); False where there is none
        self.compiled_proposal = None
        # the proposers' CUDA graphs (medusa.runtime.StepGraph), kept from call to call: each generate call builds a
        # proposer, and capturing its graphs again would cost every call
        self.step_graphs: dict = {}

    @property
    def config(self) -> MedusaConfig:
        return self.heads.config

    @property
    def feature_layers(self) -> list[int]:
        return self.heads.config.feature_layers

    @property
    def device(self) -> torch.device:
        return self.base.device

    # ---------------------------------------------------------------- construction
    @classmethod
    @releases_openmp_pool
    def from_base(
        cls,
        base: BaseSource = None,
        *,
        num_heads: int = 4,
        num_layers: int = 1,
        projection: str = "shared",
        dtype=None,
        device=None,
        tokenizer=None,
        tree=None,
        plan: str | None = None,
        engine: str | None = None,
        compile: bool | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
    ) -> MedusaModel:
        """Fresh (untrained) heads on a base model, to train: each head starts as the identity on the base
        projection. Until they are trained, generate guesses with prompt lookup (`default_proposer`), and the plan
        ("auto", as in from_pretrained) runs it on this machine's fastest engine, guarded online: a base with no
        heads of its own decodes faster than transformers' `generate` without any training.
        `token`, `cache_dir` and `local_files_only` go to transformers with the base and its tokenizer."""
        model, tokenizer = load_target(
            base,
            dtype=dtype,
            device=device,
            tokenizer=tokenizer,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
        lm_head = model.get_output_embeddings()
        config = MedusaConfig(
            hidden_size=model.config.get_text_config().hidden_size,
            vocab_size=lm_head.weight.shape[0],
            num_heads=num_heads,
            num_layers=num_layers,
            projection=projection,
            base_model_name_or_path=_base_reference(base, model),
        )
        heads = MedusaHeads(config, base_lm_head=lm_head)
        medusa = cls(model, heads, tokenizer, tree=_tree_arg(tree))
        medusa.heads_trained = False
        return medusa._planned(plan, engine, compile)

    @classmethod
    @releases_openmp_pool
    def from_pretrained(
        cls,
        path: str | os.PathLike | None = None,
        *,
        base: BaseSource = None,
        dtype=None,
        device=None,
        tokenizer=None,
        tree=None,
        plan: str | None = None,
        engine: str | None = None,
        revision: str | None = None,
        device_map=None,
        compile: bool | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
    ) -> MedusaModel:
        """Load heads from a directory or a Hub repo id (default: the shipped SmolLM2 heads) onto their base, or onto
        `base`.

        The directory holds `medusa_config.json` + `medusa_heads.safetensors` (and `adapter_*` for Medusa-2), or is
        an official Medusa / vLLM export (`config.json` + safetensors; see medusa.heads_io). A Hub id ("org/name",
        `revision=` a branch, tag or commit) is fetched once and cached by huggingface_hub (`HF_HUB_OFFLINE=1` or
        `local_files_only=True`: the cache only): its config files first, then its weights only if they are heads (a
        base model's id is refused naming `from_base`). The base the heads name is loaded at the revision their
        config records. `device_map` goes to transformers with the base; `token`, `cache_dir` and
        `local_files_only` go to huggingface_hub with the heads and to transformers with the base and its tokenizer.

        plan: "auto" (default; `$MEDUSA_PLAN` changes it) measures this machine once and chooses the engine, tree
        and proposer generate uses (medusa.plan; cached, see `model.plan`); "off" keeps the eager engine and the
        heads' own tree. `tree=` and `engine=` here, and `tree=` / `proposer=` / `engine=` in generate, override it.
        compile: whether the plan may choose the `inductor` engine (default: `$MEDUSA_COMPILE` != "0"): on a CPU it
        compiles once per machine (minutes, then cached; docs/engines.md), on a GPU in each process.
        dtype: the target's precision, the user's choice (medusa.precision): "float32" (default, exact), "bfloat16",
        "int8" / "int4" (weight-only, CPU), "w8a8" (int8 weights and activations, x86 CPU) or "auto"
        (bf16 where the hardware computes it natively, else float32); bf16 on a CPU that only emulates it is refused.
        """
        model = cls._load(
            path,
            base=base,
            dtype=dtype,
            device=device,
            tokenizer=tokenizer,
            tree=tree,
            revision=revision,
            device_map=device_map,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
        return model._planned(plan, engine, compile)

    @classmethod
    def _load(cls, path, *, base, dtype, device, tokenizer, tree, revision=None, device_map=None, **hub) -> MedusaModel:
        """from_pretrained without the plan; `hub`: token, cache_dir, local_files_only."""
        if path is None:
            if not (DEFAULT_HEADS_DIR / CONFIG_NAME).is_file():
                logger.warning("no shipped heads found in %s: using untrained heads", DEFAULT_HEADS_DIR)
                return cls.from_base(
                    base, dtype=dtype, device=device, tokenizer=tokenizer, tree=tree, plan="off", **hub
                )
            path = DEFAULT_HEADS_DIR
        path = resolve_heads(path, revision, **hub)
        heads = load_heads(path)  # any layout, checked before the (slow) base load
        if base is None and heads.config.base_model_name_or_path is None:
            raise ValueError(
                f"the heads in {path} do not name their base model (base_model_name_or_path is null): "
                "pass base= (a Hub id, directory, .gguf file or loaded model)"
            )
        adapter = has_adapter(path)
        named = base is None  # the heads' own base: at the revision they were trained on, when recorded
        model, tokenizer = load_target(
            heads.config.base_model_name_or_path if named else base,
            dtype=dtype,
            device=device,
            tokenizer=tokenizer,
            device_map=device_map,
            revision=heads.config.revision if named else None,
            **hub,
        )
        if adapter:  # Medusa-2: LoRA-adapted base
            model = merge_adapter(model, path)
        medusa = cls(model, heads, tokenizer, tree=_tree_arg(tree))
        medusa.adapter = adapter_files(path) if adapter else None
        medusa.accuracy, medusa.decoded_taus = load_accuracy(path)
        return medusa

    @classmethod
    @releases_openmp_pool
    def from_draft_model(
        cls,
        target: BaseSource = None,
        draft: BaseSource = None,
        *,
        num_speculative_tokens: int = 5,
        dtype=None,
        device=None,
        tokenizer=None,
        draft_tokenizer=None,
        num_nodes: int | None = None,
        copy_ngram: int | None = None,
        plan: str | None = None,
        engine: str | None = None,
        compile: bool | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
    ):
        """Classic speculative decoding (Leviathan et al.): `draft`, a smaller causal LM with the target's tokenizer,
        proposes `num_speculative_tokens` tokens per step. target/draft: Hub id, directory, .gguf or loaded model
        (target None: the embedded SmolLM2). Returns a `medusa.draft.DraftModel` with this class's `generate`.
        An EAGLE-3 draft (a directory or Hub repo in the speculators or EAGLE-3 layout, `embedded:<name>` for one
        shipped with the package, such as the embedded SmolLM2's `embedded:smollm2-135m-instruct-eagle3`, or a
        `medusa.eagle3.Eagle3Draft`) reads
        the target's hidden states: that returns a `medusa.eagle3.Eagle3Model`, which with `num_nodes` drafts a
        dynamic tree of that many nodes (root included), `num_speculative_tokens` deep, instead of a chain, whose
        nodes also try the copy guess of the last `copy_ngram` tokens (default medusa.eagle3.COPY_NGRAM; 0: none);
        `plan`, `engine` and `compile` are from_pretrained's (plan "auto" by default: the engine and, unless
        `num_nodes` is given, the tree size, from the draft's decoded taus where its directory keeps them and they
        were decoded with this `copy_ngram`).
        `token`, `cache_dir` and `local_files_only` go to transformers with the models loaded by Hub id.
        """
        hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
        draft_dir = resolve_draft(draft, **hub) if isinstance(draft, (str, os.PathLike)) else None
        if isinstance(draft, Eagle3Draft) or draft_dir is not None:
            if draft_tokenizer is not None:
                raise ValueError(
                    "an EAGLE-3 draft uses the target's tokenizer and embeddings: leave draft_tokenizer unset"
                )
            target_model, tokenizer = load_target(target, dtype=dtype, device=device, tokenizer=tokenizer, **hub)
            decoded = None
            if draft_dir is not None:
                decoded = load_draft_taus(draft_dir)
                draft, _ = load_eagle3(draft_dir)
            model = Eagle3Model(
                target_model,
                draft.to(target_model.dtype),
                tokenizer,
                num_speculative_tokens,
                num_nodes=num_nodes,
                copy_ngram=COPY_NGRAM if copy_ngram is None else copy_ngram,
            )
            if decoded is not None and decoded.get("copy_ngram", 0) != model.copy_ngram:
                logger.warning(
                    "%s's decoded taus were decoded with copy_ngram=%s, not %s: the plan weighs no tree sizes (write "
                    "them again with medusa accuracy --taus --eagle3 DRAFT --heads-dir)",
                    draft_dir,
                    decoded.get("copy_ngram", 0),
                    model.copy_ngram,
                )
                decoded = None
            model.decoded_taus = decoded
            return model._planned(plan, engine, compile)
        if num_nodes is not None or copy_ngram is not None:
            raise ValueError(
                "num_nodes and copy_ngram apply to EAGLE-3 drafts: a draft model proposes a chain "
                "(num_speculative_tokens)"
            )
        if plan == "auto" or engine is not None or compile is not None:
            raise ValueError(
                "plan, engine and compile apply to EAGLE-3 drafts: a draft model runs on the engine generate(engine=) "
                "names (default eager)"
            )
        return DraftModel.load(
            target,
            draft,
            num_speculative_tokens=num_speculative_tokens,
            dtype=dtype,
            device=device,
            tokenizer=tokenizer,
            draft_tokenizer=draft_tokenizer,
            **hub,
        )

    def save_pretrained(self, directory: str | os.PathLike, dtype: str | torch.dtype | None = None) -> None:
        """Write `medusa_config.json` + `medusa_heads.safetensors` atomically (temporary folder, then rename), with
        the Medusa-2 adapter the heads were loaded with (the heads pair with the base before it was merged), a model
        card (README.md) and transformers' `custom_generate/` hook (medusa.custom_generate: `base.generate(**inputs,
        custom_generate=directory, trust_remote_code=True)` decodes with these heads).

        `dtype` (e.g. "bfloat16") stores the weights in that precision: half the file of fp32 heads.
        """
        self._save(Path(directory), dtype, heads_location=str(Path(directory).resolve()))

    def _save(self, directory: Path, dtype=None, *, heads_location: str, revision: str | None = None) -> None:
        """save_pretrained into `directory`, its hook naming `heads_location` (at `revision`) as where the heads are
        loaded from: the folder itself, or the Hub repo it is uploaded to."""
        dtype = resolve_dtype(dtype) if dtype is not None else None

        def write(tmp: Path) -> None:
            save_heads(self.heads, tmp, tree=self.tree, dtype=dtype)
            if self.accuracy is not None:
                save_accuracy(tmp, self.accuracy, source="saved with the heads", decoded=self.decoded_taus)
            for name, content in (self.adapter or {}).items():
                (tmp / name).write_bytes(content)
            write_hook(tmp, heads_location, revision)
            (tmp / CARD_NAME).write_text(model_card(self.config, location=heads_location))

        write_directory(directory, write)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        revision: str | None = None,
        commit_message: str = "Upload Medusa heads",
        token: str | None = None,
    ) -> str:
        """Upload the heads directory `save_pretrained` writes (model card included) to the Hub as one commit;
        returns the commit URL."""
        return push_to_hub(
            lambda folder: self._save(folder, heads_location=repo_id, revision=revision),
            repo_id,
            private=private,
            revision=revision,
            commit_message=commit_message,
            token=token,
        )

    # ---------------------------------------------------------------- generation
    def tree_paths(self, tree=None) -> list[list[int]]:
        """The rank paths a call given `tree` builds its proposal on: `tree` (paths, a name or a JSON path), else the
        plan's tree, else the heads' own (a plain plan has none: its guard-free calls use the heads')."""
        return _tree_arg(tree) or (self.plan.tree if self.plan is not None else None) or self.tree

    def batch_layout(self, lengths: list[int], max_new_tokens: int, engine: str | None, proposer, tree) -> BatchLayout:
        """The plan's layout for a batch of prompts of `lengths` tokens (medusa.plan.batch_choice, timed per batch
        size on first use, and medusa.plan.lay_out for these lengths and `max_new_tokens`, expecting the share of
        each tree's tau this model's batches accepted so far: `acceptance`): with no engine named, the fastest of
        decoding the rows together (on the faster batch engine, with one of the trees its rows can afford or
        plainly) and one at a time (as the plan decodes one sequence); on a named batch engine, the tree timed
        there. A proposer or tree the call names is kept."""
        if self.plan is None:
            return super().batch_layout(lengths, max_new_tokens, engine, proposer, tree)
        choice = batch_choice(self, len(lengths), engine=engine)
        named = proposer is not None or tree is not None
        if engine is not None:
            if named:
                return BatchLayout(engine, False, proposer, tree)
            expected = choice.get("tau") if choice["proposer"] != "plain" else None
            return BatchLayout(engine, False, choice["proposer"], choice["tree"] or None, expected)
        share = self.acceptance.share
        engine, one_at_a_time, chosen, chosen_tree, _ = lay_out(
            choice, lengths, max_new_tokens, proposer == "plain", share
        )
        if named:
            return BatchLayout(engine, one_at_a_time, proposer, tree)
        if one_at_a_time:  # as the plan decodes one sequence
            expected = choice["alone_tau"] if self.plan.proposer != "plain" else None
        else:
            trees = [t["tau"] for t in choice["trees"] if t["tree"] == chosen_tree] if chosen_tree else []
            expected = trees[0] if trees else None
        return BatchLayout(engine, one_at_a_time, chosen, chosen_tree, expected)

    def budget_trees(self, batch) -> None:
        """The batch's rows that propose dynamic trees take the node budget the plan lays out for a batch of their
        number on its engine (more rows, fewer nodes each: a step verifies rows x nodes tokens)."""
        rows = batch.active
        if not batch.budgeted:
            return  # rows that guess no dynamic tree (decoded plainly): no layout to ask for, nor to time first
        if len(rows) == 1 and self.plan is not None and self.plan.proposer == "dynamic":
            batch.budget_trees(len(self.plan.tree) + 1)  # one row: one sequence, the plan's own tree
            return
        left = max(row.max_new_tokens - len(row.new) for row in rows)
        layout = self.batch_layout([row.state.length for row in rows], left, batch.engine.name, None, None)
        batch.budget_trees(self._layout_nodes(layout))

    def _layout_nodes(self, layout: BatchLayout) -> int:
        """The nodes (root included) a step of `layout`'s tree verifies: 1 where it decodes plainly."""
        return 1 if layout.proposer == "plain" else len(self.tree_paths(layout.tree)) + 1

    def observe_batch(self, layout: BatchLayout, stats) -> None:
        """A batch decoded with the proposer and tree the plan chose for it (together, or one row at a time as it
        decodes one sequence): what its rows' guessing steps accepted, for later layouts (steps the online guard
        decoded plainly guessed nothing; steps of the larger trees a batch's last rows took are not the layout's)."""
        if layout.expected_tau is None:  # not the plan's choice
            return
        nodes = self._layout_nodes(layout)
        accepted = [
            n
            for n, depth, size in zip(stats.accepted_lengths, stats.proposed_lengths, stats.verified_nodes)
            if depth and size <= nodes
        ]
        if accepted:
            self.acceptance.add(layout.expected_tau, accepted)

    def prepare_proposal(self, engine) -> None:
        """Where `engine` compiles the target ahead of time (the inductor engine on a CPU), compile what proposes too
        (seconds, once on this machine and heads; loaded after): every later call proposes with it."""
        if not self.heads_trained:  # they propose only when asked to, and compiling them would cost every load
            return
        if getattr(engine, "ahead_of_time", False) and self.compiled_proposal is None:
            on_cpu = self.device.type == "cpu"
            self.compiled_proposal = (
                on_cpu and compile_proposal(self.proposal_heads, self.candidate_projection) or False
            )

    def make_proposer(self, proposer: str | None, tree, sampling: SamplingConfig, generator, engine=None):
        """The plan's proposer and tree by default (else Medusa heads over the heads' static tree); `proposer` names
        another from the registry (plain, dynamic, hybrid, ...). The heads run as they are on any `engine`."""
        self.prepare_proposal(engine)
        chosen_by_plan = proposer is None and self.plan is not None
        if chosen_by_plan:
            proposer = self.plan.proposer
        paths = self.tree_paths(tree)
        buffers = build_buffers(TreeSpec(paths, self.config.num_heads), self.config.num_heads)
        built = get_proposer(proposer or self.default_proposer)(self, buffers.to(self.device))
        if not chosen_by_plan or proposer == "plain":  # an explicit proposer runs as asked
            return built
        # plain decoding where guessing stops paying, online (medusa.guard)
        return self.guarded(built)


def _candidate_dtype(base) -> torch.dtype:
    """bf16 for proposing under an fp32 base on a CPU that computes bf16 natively (ranking only: half the bytes),
    else the base dtype: where bf16 is emulated (AVX2) a 16-row bf16 projection took 50.7 ms against 15.4 in fp32."""
    if base.dtype == torch.float32 and base.device.type == "cpu" and native_bf16():
        return torch.bfloat16
    return base.dtype


def _tree_arg(tree) -> list[list[int]] | None:
    """None (the default), a list of rank paths, or a tree name / JSON path -> rank paths (None for the default)."""
    if tree is None:
        return None
    if isinstance(tree, (list, tuple)):
        if not tree:
            raise ValueError(
                "tree=[] holds no paths: pass None for the default tree, or proposer='plain' to decode without guesses"
            )
        return [list(p) if isinstance(p, (list, tuple)) else p for p in tree]
    if isinstance(tree, (str, os.PathLike)):
        return load_tree(tree)
    raise TypeError(
        f"tree must be a list of rank paths like [[0], [1], [0, 0]], a tree name or a JSON path, got "
        f"{type(tree).__name__} {tree!r}"
    )


def _base_reference(source: BaseSource, model) -> str | None:
    if source is None:
        return DEFAULT_BASE
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return getattr(model.config, "name_or_path", None) or None
