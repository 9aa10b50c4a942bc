"""olmo-trainer: OLMo-style, YAML-configured LLM pretraining and fine-tuning."""

__version__ = "0.1.0"
