"""Float8 weights all-gathered by FSDP2, written to a sharded checkpoint and loaded back, in one process:

    python -m olmo.testing.float8_fsdp STORE_FILE CHECKPOINT_DIR

On a GPU: NCCL, float8 tensor cores, bf16 autocast; on a CPU: gloo and torchao's emulation (FSDP units that hold
other weights beside the float8 ones, as every block's norms here, gather over gloo too). Two training steps with the
weights' scales refreshed after each, then checks that the weights are torchao's float8 wrapper, that the checkpoint
loads into a fresh float8 model bitwise and that both compute the same logits. For tests/train/test_float8.py and
tests/test_gpu.py; prints one line when all holds.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..checkpoint.save import plain_tensors
from ..config import Float8Config
from ..distributed.float8 import convert_float8, refresh_float8_scales
from ..model import OLMo
from . import tiny_model_config


def main(store: str, checkpoint: str) -> None:
    """Run the check in this process (a one-rank process group through the file ``store``), writing the
    checkpoint into the folder ``checkpoint``; raises AssertionError naming what did not hold."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    float8 = Float8Config(enabled=True, min_features=16, emulate=not cuda)

    def sharded_float8_model() -> OLMo:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = OLMo(tiny_model_config(d_model=256, n_heads=4, weight_tying=False, max_sequence_length=64))
        convert_float8(model, float8, fsdp=True)
        for block in model.transformer.typed_blocks():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)
        model.reset_parameters()
        return model

    model = sharded_float8_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 100, (2, 64), device=device)
    for _ in range(2):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(tokens).logits.float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        refresh_float8_scales(model)
    local = type(model.transformer.typed_blocks()[0].att_proj.weight.to_local())  # type: ignore[attr-defined]
    assert local.__name__ == "WeightWithDynamicFloat8CastTensor", local
    dcp.save(plain_tensors({"model": model.state_dict()}), checkpoint_id=checkpoint)
    other = sharded_float8_model()
    state = plain_tensors({"model": other.state_dict()})
    dcp.load(state, checkpoint_id=checkpoint)
    refresh_float8_scales(other)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        assert torch.equal(model(tokens).logits, other(tokens).logits)
    print("float8 all-gather and checkpoint ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
