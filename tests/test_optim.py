import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from olmo.config import OptimizerConfig, OptimizerType, SchedulerConfig, SchedulerType
from olmo.exceptions import OLMoConfigurationError
from olmo.optim import (
    BoltOnWarmupScheduler,
    LionW,
    build_optimizer,
    build_scheduler,
    clip_grads,
    set_learning_rate,
)

LR, W, M, ALPHA = 2e-3, 10, 110, 0.1
ETA_MIN, WMIN = LR * ALPHA, 0.1 * LR


def warm(s):
    return WMIN + (LR - WMIN) * s / W


def cosine(s):
    return ETA_MIN + (LR - ETA_MIN) * (1 + math.cos(math.pi * (s - W) / (M - W))) / 2


def inv_sqrt(s):
    return LR * math.sqrt(W / max(W, s))


D = 40  # the WSD decay: the last 40 steps before M


def scheduler(name, **kwargs):
    if name == SchedulerType.wsd:
        kwargs.setdefault("t_decay", D)
    return build_scheduler(SchedulerConfig(name=name, t_warmup=W, alpha_f=ALPHA, **kwargs))


WSD_SHAPES = {
    "linear": lambda f: 1 - f,
    "cosine": lambda f: (1 + math.cos(math.pi * f)) / 2,
    "1-sqrt": lambda f: 1 - math.sqrt(f),
}


def wsd(s, shape="linear", decay=D):
    if s < W:
        return warm(s)
    if s <= M - decay:
        return LR
    return ETA_MIN if s >= M else ETA_MIN + (LR - ETA_MIN) * WSD_SHAPES[shape]((s - (M - decay)) / decay)


EXPECTED = {
    SchedulerType.cosine_with_warmup: lambda s: warm(s) if s < W else ETA_MIN if s >= M else cosine(s),
    SchedulerType.linear_with_warmup: lambda s: (
        warm(s) if s < W else ETA_MIN if s >= M else LR - (LR - ETA_MIN) * (s - W) / (M - W)
    ),
    SchedulerType.inverse_sqrt_with_warmup: lambda s: warm(s) if s < W else inv_sqrt(s),
    SchedulerType.max_scheduler: lambda s: max(
        EXPECTED[SchedulerType.cosine_with_warmup](s), EXPECTED[SchedulerType.inverse_sqrt_with_warmup](s)
    ),
    SchedulerType.constant: lambda s: LR,
    SchedulerType.constant_with_warmup: lambda s: warm(s) if s < W else LR,
    SchedulerType.cosine_linear_envelope: lambda s: (
        warm(s)
        if s < W
        else ETA_MIN
        if s >= M
        else ETA_MIN + (1 - (s - W) / (M - W)) * (LR - ETA_MIN) * (1 + math.cos(math.pi * (s - W) / (M - W))) / 2
    ),
    SchedulerType.wsd: wsd,
}


@pytest.mark.parametrize("name", list(SchedulerType))
def test_schedule_matches_closed_form(name):
    sched = scheduler(name)
    for s in (0, 5, W - 1, W, 35, 60, 100, M, M + 50):
        assert sched.get_lr(LR, s, M) == pytest.approx(EXPECTED[name](s), rel=1e-12), s


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_is_warmup_then_the_peak_then_its_decay(shape):
    sched = scheduler(SchedulerType.wsd, decay_shape=shape)
    for s in (0, 5, W, 50, M - D - 1, M - D, M - D + 1, 80, 95, M - 1, M, M + 50):
        assert sched.get_lr(LR, s, M) == pytest.approx(wsd(s, shape), rel=1e-12), s
    assert sched.get_lr(LR, M - D, M) == LR and sched.get_lr(LR, M, M) == pytest.approx(ETA_MIN)
    # The decay hangs on the end: a run twice as long is at the peak where this one decays.
    assert sched.get_lr(LR, M - 1, 2 * M) == LR
    # t_decay 0: a stable run, the peak to its last step; t_max ends the decay instead of the run's length.
    assert scheduler(SchedulerType.wsd, t_decay=0).get_lr(LR, M - 1, M) == LR
    assert scheduler(SchedulerType.wsd, t_max=M).get_lr(LR, 95, 10 * M) == pytest.approx(wsd(95))


def test_wsd_refuses_what_it_cannot_do():
    with pytest.raises(OLMoConfigurationError, match="scheduler.name=wsd needs scheduler.t_decay"):
        build_scheduler(SchedulerConfig(name=SchedulerType.wsd))


def test_schedule_landmarks():
    cos = scheduler(SchedulerType.cosine_with_warmup)
    assert cos.get_lr(LR, 0, M) == pytest.approx(0.1 * LR)
    assert cos.get_lr(LR, W // 2, M) == pytest.approx(0.55 * LR)
    assert cos.get_lr(LR, W, M) == pytest.approx(LR)
    assert cos.get_lr(LR, (W + M) // 2, M) == pytest.approx((LR + ETA_MIN) / 2)
    assert cos.get_lr(LR, 10 * M, M) == pytest.approx(ETA_MIN)
    assert scheduler(SchedulerType.inverse_sqrt_with_warmup).get_lr(LR, 4 * W, M) == pytest.approx(LR / 2)
    # max_scheduler follows the cosine early and the (slower) inverse sqrt late.
    mx = scheduler(SchedulerType.max_scheduler)
    assert mx.get_lr(LR, 20, M) == pytest.approx(cosine(20)) and cosine(20) > inv_sqrt(20)
    assert mx.get_lr(LR, 100, M) == pytest.approx(inv_sqrt(100)) and inv_sqrt(100) > cosine(100)


def test_schedule_config_casts_and_overrides():
    sched = build_scheduler(SchedulerConfig(name=SchedulerType.linear_with_warmup, t_warmup=10.9, t_max=50.5))
    assert sched.t_warmup == 10 and sched.t_max == 50
    # The configured t_max wins over the one the caller passes.
    assert sched.get_lr(1.0, 30, 1000) == pytest.approx(1.0 - 0.9 * 20 / 40)
    assert sched.get_lr(1.0, 50, 1000) == pytest.approx(0.1)
    zero_start = build_scheduler(SchedulerConfig(t_warmup=10, warmup_min_lr=0.0))
    assert zero_start.get_lr(1.0, 0, 100) == 0.0
    assert zero_start.get_lr(1.0, 5, 100) == pytest.approx(0.5)


def test_inverse_sqrt_needs_warmup():
    with pytest.raises(OLMoConfigurationError, match="t_warmup"):
        build_scheduler(SchedulerConfig(name=SchedulerType.inverse_sqrt_with_warmup, t_warmup=0))


def test_bolt_on_warmup():
    inner = scheduler(SchedulerType.cosine_with_warmup)
    bolt = BoltOnWarmupScheduler(inner, 40, 60)
    target = cosine(60)
    assert bolt.get_lr(LR, 0, M) == 0.0
    assert bolt.get_lr(LR, 39, M) == 0.0
    assert bolt.get_lr(LR, 40, M) == 0.0
    assert bolt.get_lr(LR, 45, M) == pytest.approx(0.25 * target)
    assert bolt.get_lr(LR, 50, M) == pytest.approx(0.5 * target)
    assert bolt.get_lr(LR, 60, M) == pytest.approx(target)
    assert bolt.get_lr(LR, 80, M) == pytest.approx(cosine(80))


def test_grad_clip_warmup():
    sched = build_scheduler(SchedulerConfig(grad_clip_warmup_steps=5.0, grad_clip_warmup_factor=10.0))
    assert [sched.get_max_grad_norm(1.0, s) for s in (0, 1, 5, 6, 100)] == [10.0, 10.0, 10.0, 1.0, 1.0]
    assert sched.get_max_grad_norm(None, 1) is None
    assert BoltOnWarmupScheduler(sched, 0, 10).get_max_grad_norm(2.0, 3) == 20.0
    mx = build_scheduler(
        SchedulerConfig(name=SchedulerType.max_scheduler, grad_clip_warmup_steps=5, grad_clip_warmup_factor=3.0)
    )
    assert (mx.get_max_grad_norm(1.0, 5), mx.get_max_grad_norm(1.0, 6)) == (3.0, 1.0)
    assert build_scheduler(SchedulerConfig()).get_max_grad_norm(1.0, 1) == 1.0


class Tiny(nn.Module):
    def __init__(self, head_first: bool = False):
        super().__init__()
        if head_first:
            self.head = nn.Linear(4, 10, bias=False)
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4, bias=True)
        if not head_first:
            self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied input/output matrix
        self.scale = nn.Parameter(torch.ones(4))
        self.frozen = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, ids):
        return self.head(self.proj(self.norm(self.emb(ids))) * self.scale)


def groups_of(model=None, **flags):
    cfg = OptimizerConfig(name=OptimizerType.adamw, learning_rate=1e-3, weight_decay=0.1, **flags)
    opt = build_optimizer(cfg, model or Tiny())
    return [(g["param_names"], g["weight_decay"]) for g in opt.param_groups], opt


OTHERS = ["norm.bias", "norm.weight", "proj.bias", "scale"]


@pytest.mark.parametrize(
    "flags, decay, no_decay",
    [
        ({}, ["proj.weight"], ["emb.weight", *OTHERS]),
        ({"decay_embeddings": True}, ["emb.weight", "proj.weight"], OTHERS),
        ({"decay_norm_and_bias": True}, sorted([*OTHERS, "proj.weight"]), ["emb.weight"]),
        ({"no_decay_norm_and_bias": False}, sorted([*OTHERS, "proj.weight"]), ["emb.weight"]),
        ({"decay_norm_and_bias": True, "no_decay_norm_and_bias": True}, ["proj.weight"], ["emb.weight", *OTHERS]),
    ],
)
def test_param_groups(flags, decay, no_decay):
    groups, opt = groups_of(**flags)
    assert groups == [(decay, 0.1), (no_decay, 0.0)]
    assert all(g["initial_lr"] == 1e-3 and g["lr"] == 1e-3 for g in opt.param_groups)
    # The tied matrix is counted once and the frozen parameter not at all.
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == 6


def test_param_groups_single_group_and_tie_order():
    groups, _ = groups_of(decay_embeddings=True, decay_norm_and_bias=True)
    assert groups == [(sorted(["emb.weight", "proj.weight", *OTHERS]), 0.1)]
    # Listed under its first name (the Linear's), the tied matrix still follows the embedding rule.
    groups, _ = groups_of(Tiny(head_first=True))
    assert groups == [(["proj.weight"], 0.1), (["head.weight", *OTHERS], 0.0)]


def test_set_learning_rate_keeps_weight_decay():
    _, opt = groups_of()
    set_learning_rate(opt, 0.5)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.5, 0.1), (0.5, 0.0)]


def test_lionw_matches_hand_computation():
    lr, wd, b1, b2 = 0.1, 0.2, 0.9, 0.99
    p0 = torch.tensor([1.0, -2.0, 0.5, 3.0])
    g1, g2 = torch.tensor([0.3, -0.1, 2.0, -1.0]), torch.tensor([-0.5, -0.2, 0.1, 4.0])
    p, idle = nn.Parameter(p0.clone()), nn.Parameter(torch.ones(2))
    opt = LionW([p, idle], lr=lr, betas=(b1, b2), weight_decay=wd)

    p.grad = g1.clone()
    opt.step()
    p1 = p0 * (1 - lr * wd) - lr * torch.sign((1 - b1) * g1)
    m1 = (1 - b2) * g1
    torch.testing.assert_close(p.detach(), p1)

    p.grad = g2.clone()
    opt.step()
    p2 = p1 * (1 - lr * wd) - lr * torch.sign(b1 * m1 + (1 - b1) * g2)
    torch.testing.assert_close(p.detach(), p2)
    torch.testing.assert_close(opt.state[p]["exp_avg"], b2 * m1 + (1 - b2) * g2)
    # A parameter without a gradient is neither decayed nor given state.
    assert torch.equal(idle.detach(), torch.ones(2)) and len(opt.state[idle]) == 0


def test_lionw_without_weight_decay_and_selective_updates():
    p = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = LionW([p], lr=0.5, weight_decay=0.0)
    p.grad = torch.tensor([2.0, -3.0, 0.5])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.5, 2.5, 2.5]))

    q = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = LionW([q], lr=0.5, weight_decay=0.1, selective_updates=True)
    q.grad = torch.tensor([1.0, 0.0, 1.0])
    opt.step()
    q.grad = torch.tensor([0.0, 0.0, -1.0])
    opt.step()
    # Entry 1 never had a gradient and entry 0 none in step 2: they are left exactly as they were.
    assert q[1].item() == 2.0 and q[0].item() == pytest.approx(1.0 * 0.95 - 0.5)
    assert opt.state[q]["exp_avg"][0].item() == pytest.approx(0.01)


def test_adamw_selective_updates_rejected():
    with pytest.raises(OLMoConfigurationError, match="selective_updates"):
        build_optimizer(OptimizerConfig(name=OptimizerType.adamw, selective_updates=True), Tiny())


def test_build_optimizer_adamw_matches_torch():
    torch.manual_seed(0)
    ours = Tiny()
    ref = copy.deepcopy(ours)
    cfg = OptimizerConfig(
        name=OptimizerType.adamw, learning_rate=1e-2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6
    )
    opt = build_optimizer(cfg, ours)
    by_name = dict(ref.named_parameters())
    ref_opt = torch.optim.AdamW(
        [
            {"params": [by_name["proj.weight"]], "weight_decay": 0.1},
            {"params": [by_name[n] for n in ["emb.weight", *OTHERS]], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.8, 0.9),
        eps=1e-6,
    )
    for _ in range(5):
        ids = torch.randint(0, 10, (3, 5))
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            optimizer.zero_grad()
            model(ids).square().mean().backward()
            optimizer.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert isinstance(build_optimizer(OptimizerConfig(), Tiny()), LionW)


def params_with_grads(seed=0, scale=1.0):
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2))]
    for p in params[:2]:
        p.grad = torch.randn_like(p) * scale
    return params  # the last one has no gradient


def test_clip_grads_fixed_matches_torch():
    params = params_with_grads(scale=5.0)
    copies = [nn.Parameter(p.detach().clone()) for p in params[:2]]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    total = clip_grads(LionW(params), max_grad_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert total.dtype == torch.float32 and total.shape == () and total > 1.0
    torch.testing.assert_close(total, expected)
    for c, p in zip(copies, params):
        torch.testing.assert_close(p.grad, c.grad)
    assert params[2].grad is None


def test_clip_grads_under_max_or_disabled_leaves_grads():
    params = params_with_grads()
    before = [p.grad.clone() for p in params[:2]]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]))
    for max_norm in (1e6, None):
        total = clip_grads(LionW(params), max_norm)
        torch.testing.assert_close(total, expected)
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_clip_grads_bf16_and_no_grads():
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.full((4,), 3.0, dtype=torch.bfloat16)
    assert clip_grads(LionW([p]), 1.0).dtype == torch.float32
    assert p.grad.dtype == torch.bfloat16 and p.grad.float().norm().item() == pytest.approx(1.0, rel=1e-2)
    q = nn.Parameter(torch.ones(3))
    assert clip_grads(LionW([q]), 1.0).item() == 0.0


def test_adaptive_clipping():
    a, b, idle = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([a, b, idle], lr=1e-3, betas=(0.9, 0.95))
    ga, gb = torch.tensor([1.0, 2.0, 2.0, 4.0]), torch.tensor([3.0, 0.0, 4.0])  # norms 5 and 5

    def clip(step, scale_a, max_grad_norm=None):
        a.grad, b.grad = ga * scale_a, gb.clone()
        return clip_grads(opt, max_grad_norm, 2.0, step)

    # Step 1: the average starts at the current norm, so nothing is clipped, and nothing is stored yet
    # (AdamW has not created its state); AdamW must still step normally afterwards.
    clip(1, 1.0)
    assert torch.equal(a.grad, ga) and "grad_norm_exp_avg" not in opt.state[a]
    opt.step()
    # Step 2: the average is initialised to the current norm and kept.
    clip(2, 1.0)
    torch.testing.assert_close(opt.state[a]["grad_norm_exp_avg"], torch.tensor(5.0))
    opt.step()
    # Step 3: a 10x spike on `a` is clipped to ratio * average = 10; the average moves towards the clipped
    # norm with beta = max(betas) = 0.95. The global max_grad_norm is ignored when a ratio is given.
    total = clip(3, 10.0, max_grad_norm=1e-3)
    torch.testing.assert_close(total, torch.tensor(math.sqrt(50.0**2 + 5.0**2)))
    torch.testing.assert_close(a.grad.norm(), torch.tensor(10.0))
    torch.testing.assert_close(a.grad, ga * 10.0 * (10.0 / (50.0 + 1e-6)))
    torch.testing.assert_close(opt.state[a]["grad_norm_exp_avg"], torch.tensor(5.0 + 0.05 * (10.0 - 5.0)))
    torch.testing.assert_close(b.grad, gb)
    torch.testing.assert_close(opt.state[b]["grad_norm_exp_avg"], torch.tensor(5.0))
    assert idle.grad is None and "grad_norm_exp_avg" not in opt.state[idle]
    opt.step()


def test_dtensor_params_single_rank():
    """FSDP2 hands the optimizer DTensor parameters and gradients; a 1-rank mesh exercises those code paths."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for name in OptimizerType:
            torch.manual_seed(0)
            plain = nn.Linear(3, 4)
            sharded = fully_shard(copy.deepcopy(plain), mesh=mesh)
            x = torch.randn(2, 3)
            norms = []
            for model in (plain, sharded):
                opt = build_optimizer(OptimizerConfig(name=name, learning_rate=0.1), model)
                for step in (1, 2, 3):
                    opt.zero_grad()
                    model(x * step).sum().backward()
                    norms.append(clip_grads(opt, 0.5, 1.5 if step == 3 else None, step))
                    opt.step()
            for got, want in zip(norms[3:], norms[:3]):
                torch.testing.assert_close(got, want)
            torch.testing.assert_close(sharded.weight.full_tensor(), plain.weight.detach())
    finally:
        dist.destroy_process_group()
