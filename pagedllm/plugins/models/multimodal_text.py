"""The text side of vision-language checkpoints: Gemma 3 and Llama 4 `...ForConditionalGeneration`.

The released Gemma 3 (4B and up) and Llama 4 checkpoints are vision-language models: their
config nests the language model's config under `text_config` beside a vision config, and
their files hold the language model's tensors under a prefix next to a vision tower and a
projector. pagedllm serves text only (the server refuses image parts), which is how many
vLLM users run these checkpoints. Each class here is the existing text model, built from
the config's text part, loading the language model's tensors under the text model's names
and skipping the vision tensors (with one INFO line, so that it is never silent).

Tensor names, as transformers 5.24 reads them (it accepts both layouts; save_pretrained
still writes the older one):
  newer   model.language_model.*   lm_head.*                 model.vision_tower.* (or vision_model.*),
                                                             model.multi_modal_projector.*
  older   language_model.model.*   language_model.lm_head.*  vision_tower.* / vision_model.*,
                                                             multi_modal_projector.*
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, ClassVar, Iterator

import torch

from pagedllm.core.contracts import KVCacheSpec, ModelContext
from pagedllm.core.loader import language_model_config
from pagedllm.plugins.models.gemma import Gemma3ForCausalLM
from pagedllm.plugins.models.llama4 import Llama4ForCausalLM

logger = logging.getLogger("pagedllm")

# checkpoint prefix of the language model -> the text model's prefix
_LANGUAGE_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# the image side, each found bare or under "model."
_VISION_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.")


def text_side(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under the text model's names; vision tower and
    projector tensors are dropped (counted in one INFO line). Any other name passes
    unchanged, so the text model refuses what it does not know."""
    skipped = 0
    for name, tensor in weights:
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare.startswith(_VISION_PREFIXES):
            skipped += 1
            continue
        for old, new in _LANGUAGE_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor
    if skipped:
        logger.info("vision tower not loaded: pagedllm serves text only (%d vision tensors skipped)", skipped)


class TextOfConditionalGeneration:
    """Mixin, listed before a text CausalLM: the worker hands the class the whole composite
    config; it builds and sizes the text model from the text part."""

    # whether the head is tied by the top-level config's tie_word_embeddings (transformers'
    # Gemma 3 keeps lm_head on the composite class) rather than by the text config's (Llama 4
    # keeps it inside its language model)
    tie_from_top_level: ClassVar[bool] = False

    @classmethod
    def text_config(cls, hf_config: Any) -> Any:
        """The config the text model is built from."""
        text = language_model_config(hf_config)
        if text is hf_config:
            raise ValueError(f"{cls.__name__} expects a composite config with a text_config (the language "
                             "model's); this one has none")
        if cls.tie_from_top_level and hasattr(hf_config, "tie_word_embeddings"):
            text = copy.deepcopy(text)
            text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
        return text

    def __init__(self, context: ModelContext) -> None:
        self.composite_config = context.hf_config
        super().__init__(dataclasses.replace(context, hf_config=self.text_config(context.hf_config)))

    @classmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        return super().kv_cache_spec(cls.text_config(hf_config))

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(text_side(weights))


class Gemma3ForConditionalGeneration(TextOfConditionalGeneration, Gemma3ForCausalLM):
    """Gemma 3 4B/12B/27B (vision-language): the text model, Gemma3ForCausalLM, less the
    final logit soft-cap: transformers' composite class computes its logits without one
    (its Gemma3ForCausalLM applies it). The released checkpoints set none, so the two
    agree on them; a config that sets one gets transformers' composite semantics, said once."""

    tie_from_top_level = True

    def __init__(self, context: ModelContext) -> None:
        super().__init__(context)
        if self.final_soft_cap:
            logger.info("final_logit_softcapping=%s not applied: transformers' Gemma3ForConditionalGeneration "
                        "does not apply it", self.final_soft_cap)
        self.final_soft_cap = None


class Llama4ForConditionalGeneration(TextOfConditionalGeneration, Llama4ForCausalLM):
    """Llama 4 Scout / Maverick: the text model, Llama4ForCausalLM."""
