"""Model registry: HF architecture name (config.json's `architectures`) → model class."""

from __future__ import annotations

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.cohere2 import Cohere2ForCausalLM
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
from swaserve.worker.models.exaone4 import Exaone4ForCausalLM
from swaserve.worker.models.gemma3 import Gemma3ForCausalLM
from swaserve.worker.models.gemma4 import Gemma4ForCausalLM
from swaserve.worker.models.gpt_oss import GptOssForCausalLM
from swaserve.worker.models.llama4 import Llama4ForCausalLM
from swaserve.worker.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from swaserve.worker.models.olmo3 import Olmo3ForCausalLM

MODEL_REGISTRY: dict[str, type[HybridCausalLM]] = {
    GPT_OSS: GptOssForCausalLM,
    MIMO_V2_FLASH: MiMoV2FlashForCausalLM,
    GEMMA3: Gemma3ForCausalLM,
    COHERE2: Cohere2ForCausalLM,
    OLMO3: Olmo3ForCausalLM,
    EXAONE4: Exaone4ForCausalLM,
    LLAMA4: Llama4ForCausalLM,
    GEMMA4: Gemma4ForCausalLM,
}


def get_model_class(architecture: str) -> type[HybridCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(MODEL_REGISTRY)
        raise UnknownArchitectureError(
            f"no model class for architecture {architecture!r}; supported: {supported}"
        ) from None
