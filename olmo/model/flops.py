"""Peak FLOP/s of a device (known GPUs, or this CPU's measured matmul rate) and model FLOPs utilization."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

from ..util import machine_info, write_result_file

__all__ = [
    "PeakFlops",
    "device_peak_flops",
    "gpu_peak_flops",
    "cpu_peak_flops",
    "model_flops_utilization",
    "training_flops_per_token",
]

log = logging.getLogger(__name__)

# Dense bf16 peaks in FLOP/s. H200 has the same tensor cores as H100 SXM; matching "H100" alone
# would miss it, and falling back to an A100 figure would overstate MFU ~3x.
_GPU_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)
# A CPU peak measured while other work held more than a quarter of its threads' time is provisional.
_MIN_CPU_SHARE = 0.75


@dataclass(frozen=True)
class PeakFlops:
    """One device's peak FLOP/s, where the figure came from, and how to correct it should an MFU above 1
    prove it wrong.

    :param cache_file: the per-machine cache the figure was read from or written to (measured CPU peaks only).
    :param cache_key: its entry in that file.
    """

    flops: float
    source: str
    fix: str
    cache_file: Optional[Path] = None
    cache_key: Optional[str] = None


def device_peak_flops(device: torch.device, override: Optional[float] = None) -> Optional[PeakFlops]:
    """Peak FLOP/s of one device: ``override`` (``speed_monitor.gpu_flops_available``) when set, else a known
    GPU's dense bf16 figure, or this CPU's fp32 matmul rate (see :func:`cpu_peak_flops`). None when unknown."""
    if override:
        return PeakFlops(
            float(override), "speed_monitor.gpu_flops_available", "Set it to one device's real peak FLOP/s."
        )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return PeakFlops(
                peak,
                f"the dense bf16 peak of {name}",
                "The model's FLOP count or this peak is wrong for this setup; set "
                "speed_monitor.gpu_flops_available to the device's real peak.",
            )
        log.warning("Unknown GPU %r: MFU is not reported (set speed_monitor.gpu_flops_available).", name)
        return None
    if device.type == "cpu":
        return cpu_peak_flops()
    return None


def gpu_peak_flops(name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s for a GPU's ``torch.cuda.get_device_name``, or None if unknown."""
    for key, flops in _GPU_PEAKS:
        if key in name:
            return flops
    return None


def model_flops_utilization(
    achieved_flops: float, peak: Optional[PeakFlops], warn: bool = True
) -> Optional[float]:
    """``achieved_flops / peak.flops``, or None when the peak is unknown or the ratio is above 1: an MFU above 1
    is never true (the peak or the FLOP count is wrong), so none is reported.

    :param warn: for a ratio above 1, warn (naming the peak's source and the fix) and drop a cached CPU peak;
        a caller that already did so this run passes False.
    """
    if peak is None:
        return None
    mfu = achieved_flops / peak.flops
    if mfu <= 1:
        return mfu
    if warn:
        if peak.cache_file is not None and peak.cache_key is not None:
            # The cached measurement is proven too low (taken while other work shared the cores): drop it, so
            # that the next run measures again rather than repeat this warning forever.
            cache = _read_peak_cache(peak.cache_file)
            if cache.pop(peak.cache_key, None) is not None:
                _write_peak_cache(peak.cache_file, cache)
        log.warning(
            "MFU would be %.2f: %.4g FLOP/s achieved against a peak of %.4g FLOP/s from %s. An MFU above 1 is never "
            "true, so none is reported. %s",
            mfu,
            achieved_flops,
            peak.flops,
            peak.source,
            peak.fix,
        )
    return None


def cpu_peak_flops() -> PeakFlops:
    """This CPU's fp32 matmul rate at the current thread count, measured and cached per machine.

    The cache is a JSON file, ``$XDG_CACHE_HOME/olmo-trainer/cpu_peak_flops.json`` (``~/.cache/...`` without
    XDG_CACHE_HOME), keyed by CPU model, core count, thread count and torch version, and replaced atomically.
    Each entry keeps the best rate measured and the share of the cores that measurement got: below
    :data:`_MIN_CPU_SHARE` (other work was running) the entry is provisional and is measured again, keeping the
    best, by a later run that finds the machine idle; so is one measured while the machine was busy (its load
    average above a quarter of its cores), since other work slows a matmul in ways the share does not show (memory
    bandwidth, caches). An entry that an MFU above 1 proves too low is dropped
    (see :func:`model_flops_utilization`).
    """
    path, key = _peak_cache_path(), _cpu_key()
    cache = _read_peak_cache(path)
    entry, cached = cache.get(key), None
    if isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) for k in ("peak_flops", "cpu_share")
    ):
        cached = (float(entry["peak_flops"]), float(entry["cpu_share"]))
    measured_idle = entry.get("idle", True) if isinstance(entry, dict) else True  # older entries do not say
    final = cached is not None and cached[1] >= _MIN_CPU_SHARE and measured_idle is not False
    if cached is not None and (final or not _machine_idle()):
        flops = cached[0]
    else:
        idle = _machine_idle()  # a measurement on a busy machine stays provisional, whatever share it got
        measured = _measure_cpu_matmul_flops()
        log.info(
            "Measured this CPU's peak: %.4g FLOP/s, with %.0f%% of its threads' time (%s).",
            measured[0],
            100 * measured[1],
            key,
        )
        flops, share = max(measured, cached or measured)
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        cache[key] = {"peak_flops": flops, "cpu_share": share, "idle": idle, "measured": now}
        _write_peak_cache(path, cache)
    where = f", cached in {path}" if path is not None else ""
    return PeakFlops(
        flops,
        f"the fp32 matmul rate measured on this CPU{where}",
        "The cached figure is dropped, so the next run measures again (best on an idle machine); or pin "
        "speed_monitor.gpu_flops_available.",
        path,
        key,
    )


def _machine_idle() -> bool:
    """Whether the last minute's load average leaves most cores free (a good time to measure)."""
    return os.getloadavg()[0] < 0.25 * (os.cpu_count() or 1)


def _peak_cache_path() -> Optional[Path]:
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):  # the XDG spec ignores a relative (or empty) value
        try:
            root = str(Path.home() / ".cache")
        except RuntimeError:  # no home directory to be found
            return None
    return Path(root) / "olmo-trainer" / "cpu_peak_flops.json"


def _cpu_key() -> str:
    info = machine_info()
    model = info["cpu_model"] or info["processor"]
    return f"{model} | {info['cpu_count']} CPUs | {torch.get_num_threads()} threads | torch {info['torch']}"


def _read_peak_cache(path: Optional[Path]) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.info("Ignoring the unreadable CPU peak cache %s (%s); measuring again.", path, e)
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_peak_cache(path: Optional[Path], cache: dict[str, Any]) -> None:
    """Write ``cache`` to ``path`` through a temporary file and a rename, so that a reader (another rank on this
    machine, say) never sees half a file."""
    if path is None:
        return
    try:
        write_result_file(path, json.dumps(cache, indent=1, sort_keys=True))
    except OSError as e:
        log.info("Could not cache the CPU peak in %s (%s); later runs will measure it again.", path, e)


def _measure_cpu_matmul_flops(
    sizes: tuple[int, ...] = (1024, 2048), rounds: int = 4, seconds: float = 0.05
) -> tuple[float, float]:
    """The best rate over ``rounds`` short runs of each matmul size, interleaved, and the share of its threads'
    time that the best run got from the OS (1 when nothing else wanted the cores). Other work only ever lowers a
    run, so the best run is the closest to what the cores can do; larger matmuls run nearer the peak on many
    CPUs, hence more than one size."""
    # A private generator: drawing from the global RNG here would change the run's dropout draws.
    gen = torch.Generator().manual_seed(0)
    operands = [(torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)) for n in sizes]
    for a, b in operands:
        torch.mm(a, b)  # warm up the thread pool and the kernels
    return max(_matmul_rate(a, b, seconds) for _ in range(rounds) for a, b in operands)


def _matmul_rate(a: torch.Tensor, b: torch.Tensor, seconds: float) -> tuple[float, float]:
    """FLOP/s of ``a @ b`` (square matrices) repeated for about ``seconds`` (at least once), and the CPU time
    this process got over the wall time times its thread count."""
    n, calls = a.shape[0], 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while calls == 0 or time.perf_counter() - start < seconds:
        torch.mm(a, b)
        calls += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return 2 * n**3 * calls / wall, min(1.0, cpu / (wall * torch.get_num_threads()))


def training_flops_per_token(cfg: Any, n_matmul: int, seq_len: Optional[int] = None) -> int:
    """:meth:`olmo.model.OLMo.num_flops_per_token` (its docstring has the convention) of the model ``cfg`` whose
    blocks' active matmul parameters are ``n_matmul``."""
    from ..config.linear_attention_sections import LINEAR_ATTENTION

    if cfg.weight_tying:
        n_matmul += cfg.effective_embedding_size * cfg.d_model
    seq_len = cfg.max_sequence_length if seq_len is None else seq_len
    head_dim = cfg.d_model // cfg.n_heads
    kinds, windows = cfg.layer_kinds(), cfg.layer_windows()
    keys = sum(min(w or seq_len, seq_len) for k, w in zip(kinds, windows) if k != LINEAR_ATTENTION)
    flops = 6 * n_matmul + 12 * cfg.n_heads * head_dim * keys
    if (la := cfg.linear_attention) is not None:
        flops += 18 * la.value_heads(cfg) * la.key_dim(cfg) * la.value_dim(cfg) * kinds.count(LINEAR_ATTENTION)
    return flops
