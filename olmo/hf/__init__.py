"""Hugging Face transformers interop: ``mapping`` (our model <-> ``OlmoForCausalLM``/``Olmo2ForCausalLM``/
``Olmo3ForCausalLM``/``OlmoeForCausalLM``/``FlexOlmoForCausalLM``/``OlmoHybridForCausalLM``: configs and state
dicts, both ways; the names re-exported here; its sliding-window and RoPE scaling part is ``olmo3``, its experts'
``olmoe``, its Gated DeltaNet layers' ``olmo_hybrid``; the config.json checks every type shares ``config_checks``), ``files`` (model
directories: config.json, safetensors shards, tokenizer and generation files) and ``conversion_checks`` (what an import
must pass before anything is written). transformers is imported inside functions only.

May import: ``olmo.checkpoint``, ``olmo.config``, ``olmo.util``, ``olmo.exceptions``.
"""

from .mapping import (
    HF_MODEL_TYPES,
    build_hf_config,
    from_hf_state,
    hf_class_listing,
    hf_config_class,
    hf_config_kwargs,
    hf_model_type,
    import_transformers,
    model_config_from_hf,
    to_hf_state,
)

__all__ = [
    "HF_MODEL_TYPES",
    "hf_class_listing",
    "hf_config_class",
    "import_transformers",
    "hf_model_type",
    "hf_config_kwargs",
    "build_hf_config",
    "model_config_from_hf",
    "to_hf_state",
    "from_hf_state",
]
