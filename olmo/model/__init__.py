"""The OLMo transformer as plain ``nn.Module`` code, and what is computed from it: ``transformer`` (``OLMo``),
``block`` (``OLMoBlock``: a sequence mixer and a feed-forward, chosen per layer by ``block_class``),
``attention_mixer`` (attention and its kernels, the KV cache), ``feed_forward`` (the dense MLP, the mixture of
experts), ``init`` (parameter init), ``blocks_api`` (OLMo's building-block names), ``layers`` (norms, RoPE, MLP),
``attention`` (SDPA, flash-attn, document masking), ``loss`` (cross entropy, z-loss, the fused output loss),
``flops`` (parameter and FLOP counts, peak device FLOP/s), ``beams`` (OLMo's beam search; its samplers in
``sampling``), ``generation`` (``OLMo.generate`` over the KV cache) and ``moe`` (the mixture-of-experts layer:
dropless top-k routing, grouped expert multiplies, auxiliary losses; built into the blocks by ``model.moe``);
``linear_attention`` (Gated DeltaNet, the mixer of ``linear_attention`` layers), ``delta_rule`` (its recurrence in
pure PyTorch) and ``delta_rule_kernels`` (flash-linear-attention's kernels on a GPU, else ``delta_rule``).

No distributed code: FSDP, tensor parallelism (each mixer's share of the heads), activation checkpointing and
compile are applied from outside (:mod:`olmo.distributed.parallelize`). May import: ``olmo.config``,
``olmo.util``, ``olmo.exceptions``.
"""

from .blocks_api import GELU, Activation, ReLU, RMSLayerNorm, RotaryEmbedding, SwiGLU
from .delta_rule_kernels import describe_linear_attention
from .layers import (
    LayerNorm,
)
from .layers import LayerNorm as LayerNormBase
from .transformer import (
    BufferCache,
    OLMo,
    OLMoBlock,
    OLMoGenerateOutput,
    OLMoLlamaBlock,
    OLMoOutput,
    OLMoSequentialBlock,
    describe_attention,
)

__all__ = [
    "Activation",
    "GELU",
    "ReLU",
    "RMSLayerNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "BufferCache",
    "LayerNorm",
    "LayerNormBase",
    "OLMoLlamaBlock",
    "OLMoSequentialBlock",
    "OLMo",
    "OLMoBlock",
    "OLMoOutput",
    "OLMoGenerateOutput",
    "describe_attention",
    "describe_linear_attention",
]
