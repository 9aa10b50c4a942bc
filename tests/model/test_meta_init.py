"""Building a model on the meta device skips its constructors' initializations (olmo.model.meta_init): no compiler
import for the processes that build a model, and the same parameters as before."""

from __future__ import annotations

import subprocess
import sys

import torch

from olmo.model import OLMo
from olmo.model.meta_init import skip_meta_init
from olmo.testing import tiny_model_config


def test_building_a_model_does_not_import_torchs_compiler():
    probe = "\n".join(
        [
            "import sys, torch",
            "from olmo.model import OLMo",
            "from olmo.testing import tiny_model_config",
            "OLMo(tiny_model_config())",
            "with torch.device('meta'):",
            "    OLMo(tiny_model_config())",
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'",
            "print('ok')",
        ]
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_only_meta_tensors_are_left_alone_and_no_random_number_is_drawn():
    state = torch.get_rng_state()
    with torch.device("meta"), skip_meta_init():
        layer = torch.nn.Linear(8, 8)
        assert layer.weight.is_meta
    assert torch.equal(state, torch.get_rng_state())
    with skip_meta_init():  # a real tensor is initialized as always
        real = torch.nn.init.normal_(torch.zeros(1000))
    assert real.std() > 0.5


def test_a_model_built_directly_or_on_meta_then_reset_is_the_same():
    torch.manual_seed(3)
    direct = OLMo(tiny_model_config())
    with torch.device("meta"):
        later = OLMo(tiny_model_config())
    later.to_empty(device="cpu")
    torch.manual_seed(3)
    later.reset_parameters()
    for (name, a), (_, b) in zip(direct.named_parameters(), later.named_parameters()):
        assert torch.equal(a, b), name
