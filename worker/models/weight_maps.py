"""Checkpoint layouts, one declared `WeightMap` per architecture.

Our model classes hold transformers' *in-memory* (packed) parameter names. Checkpoints come in
two layouts, and a model dir may mix them tensor by tensor:

- packed: exactly the in-memory names (what GPT-OSS is published in and what transformers'
  `save_pretrained` writes for it; swaserve's tiny models in `--format hf`);
- original: what MiMo-V2-Flash is published in and what transformers 5's `save_pretrained`
  writes for it — transformers' `conversion_mapping` for "mimo_v2_flash" is qwen2_moe's expert
  fusion plus `self_attn.attention_sink_bias` → `self_attn.sinks`:

      mlp.experts.{e}.gate_proj.weight [I, D] ┐ concatenated per expert → mlp.experts.gate_up_proj [E, 2I, D]
      mlp.experts.{e}.up_proj.weight   [I, D] ┘
      mlp.experts.{e}.down_proj.weight [D, I]   stacked               → mlp.experts.down_proj   [E, D, I]

`SkipRule`s name checkpoint tensors the model does not run (MiMo-V2-Flash's multi-token-
prediction layers, unless the engine drafts with them: `models.mtp`); any other tensor the map
does not place is an error in the loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from swaserve.worker.models.config import (
    COHERE2,
    EXAONE4,
    GEMMA3,
    GEMMA4,
    GPT_OSS,
    LLAMA4,
    MIMO_V2_FLASH,
    OLMO3,
)
from swaserve.worker.models.errors import UnknownArchitectureError


@dataclass(frozen=True, slots=True)
class Rename:
    """A parameter whose name ends in `packed` is stored under the name ending in `original`."""

    packed: str  # e.g. "self_attn.sinks"
    original: str  # e.g. "self_attn.attention_sink_bias"


@dataclass(frozen=True, slots=True)
class ExpertStack:
    """A packed expert parameter `<prefix><packed>` [E, P·n, ...] stored as one tensor per expert
    and part: `<prefix><part with {expert}>` [n, ...], the parts concatenated along dim 0."""

    packed: str  # e.g. "mlp.experts.gate_up_proj"
    parts: tuple[str, ...]  # e.g. ("mlp.experts.{expert}.gate_proj.weight", ...)


@dataclass(frozen=True, slots=True)
class SkipRule:
    """Checkpoint tensors matching `pattern` (a regex, searched) are not loaded."""

    pattern: str
    reason: str

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


@dataclass(frozen=True, slots=True)
class Prefix:
    """A parameter named `<packed>...` may be stored as `<original>...` (a multimodal
    checkpoint's language model: `model.` → `language_model.model.`)."""

    packed: str
    original: str


@dataclass(frozen=True, slots=True)
class Placement:
    """One checkpoint tensor's place in a parameter: `param[index]` (index () = the whole)."""

    source: str
    index: tuple[int | slice, ...]


@dataclass(frozen=True, slots=True)
class WeightMap:
    """The checkpoint layouts of one architecture besides the packed names."""

    renames: tuple[Rename, ...] = ()
    expert_stacks: tuple[ExpertStack, ...] = ()
    skip: tuple[SkipRule, ...] = ()
    prefixes: tuple[Prefix, ...] = ()

    def layouts(
        self, name: str, shape: tuple[int, ...], *, prefixed: bool = True
    ) -> list[list[Placement]]:
        """Every way the parameter `name` of `shape` may be stored, packed first; each way is
        the list of checkpoint tensors that together fill it. `prefixed=False` leaves out the
        multimodal checkpoints' prefixed names."""
        found = [[Placement(name, ())]]
        for rename in self.renames:
            if name.endswith(rename.packed):
                original = name[: -len(rename.packed)] + rename.original
                found.append([Placement(original, ())])
        for stack in self.expert_stacks:
            if name.endswith(stack.packed) and len(shape) >= 2:
                found.append(self._stacked(name[: -len(stack.packed)], stack, shape))
        for prefix in self.prefixes if prefixed else ():
            if name.startswith(prefix.packed):
                moved = prefix.original + name[len(prefix.packed) :]
                found.append([Placement(moved, ())])
        return found

    @staticmethod
    def _stacked(prefix: str, stack: ExpertStack, shape: tuple[int, ...]) -> list[Placement]:
        num_experts, rows = shape[0], shape[1] // len(stack.parts)
        return [
            Placement(prefix + part.format(expert=e), (e, slice(p * rows, (p + 1) * rows)))
            for e in range(num_experts)
            for p, part in enumerate(stack.parts)
        ]

    def skipped(self, name: str) -> SkipRule | None:
        return next((rule for rule in self.skip if rule.matches(name)), None)

    def to_original(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The same tensors under the original layout's names (what the tiny-model maker writes
        for `--format original`); names no rule covers stay as they are."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            layouts = self.layouts(name, tuple(tensor.shape), prefixed=False)
            chosen = layouts[-1] if len(layouts) > 1 else layouts[0]
            for placement in chosen:
                out[placement.source] = tensor[placement.index].contiguous()
        return out


GPT_OSS_WEIGHTS = WeightMap()
"""GPT-OSS is published (and saved by transformers) under the packed names; its experts may be
MXFP4 (`<name>_blocks` / `<name>_scales`, read by the loader for any packed expert tensor)."""

MIMO_V2_FLASH_WEIGHTS = WeightMap(
    renames=(Rename("self_attn.sinks", "self_attn.attention_sink_bias"),),
    expert_stacks=(
        ExpertStack(
            "mlp.experts.gate_up_proj",
            ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
        ),
        ExpertStack("mlp.experts.down_proj", ("mlp.experts.{expert}.down_proj.weight",)),
    ),
    # The same rule as MiMoV2FlashForCausalLM.ignored_checkpoint_tensors, with its reason.
    skip=(
        SkipRule(
            r"^model\.mtp\.",
            "multi-token-prediction layers, which swaserve runs only as "
            "speculative_method='mtp' drafts",
        ),
    ),
)

_MULTIMODAL_SKIP = (
    SkipRule(
        r"^(model\.)?(vision_model|vision_tower|multi_modal_projector|embed_vision|audio_tower|"
        r"embed_audio)\.",
        "the vision and audio towers of a multimodal checkpoint, which swaserve does not run",
    ),
)

GEMMA3_WEIGHTS = WeightMap(
    skip=_MULTIMODAL_SKIP,
    prefixes=(
        Prefix("model.", "language_model.model."),  # Gemma3ForConditionalGeneration, as published
        Prefix("lm_head.", "language_model.lm_head."),
        Prefix("model.", "model.language_model."),  # ... as transformers 5 saves it
    ),
)
"""Gemma 3 text checkpoints (`Gemma3ForCausalLM`) use the module names as they are; the
multimodal ones hold the language model under a prefix, next to a vision tower."""

COHERE2_WEIGHTS = WeightMap()
"""Cohere2 checkpoints use the module names as they are (no lm_head when tied)."""

OLMO3_WEIGHTS = WeightMap()
"""OLMo 3 checkpoints use the module names as they are."""

EXAONE4_WEIGHTS = WeightMap()
"""EXAONE 4 checkpoints use the module names as they are."""

LLAMA4_WEIGHTS = WeightMap(
    skip=_MULTIMODAL_SKIP,
    prefixes=(
        Prefix("model.", "language_model.model."),  # Llama4ForConditionalGeneration
        Prefix("lm_head.", "language_model.lm_head."),
    ),
)
"""Llama 4 text checkpoints (`Llama4ForCausalLM`) use the module names as they are, experts
packed (gate_up_proj [E, D, 2I], down_proj [E, I, D])."""

GEMMA4_WEIGHTS = WeightMap(
    skip=_MULTIMODAL_SKIP,
    prefixes=(Prefix("model.", "model.language_model."),),  # Gemma4ForConditionalGeneration
)
"""Gemma 4 text checkpoints (`Gemma4ForCausalLM`) use the module names as they are; KV-shared
layers carry no k/v projections or norms."""

WEIGHT_MAPS: dict[str, WeightMap] = {
    GPT_OSS: GPT_OSS_WEIGHTS,
    MIMO_V2_FLASH: MIMO_V2_FLASH_WEIGHTS,
    GEMMA3: GEMMA3_WEIGHTS,
    COHERE2: COHERE2_WEIGHTS,
    OLMO3: OLMO3_WEIGHTS,
    EXAONE4: EXAONE4_WEIGHTS,
    LLAMA4: LLAMA4_WEIGHTS,
    GEMMA4: GEMMA4_WEIGHTS,
}


def weight_map(architecture: str) -> WeightMap:
    if architecture not in WEIGHT_MAPS:
        raise UnknownArchitectureError(f"no checkpoint layout declared for {architecture}")
    return WEIGHT_MAPS[architecture]
