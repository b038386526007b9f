"""Accelerator catalogue: peak FLOP/s per dtype, memory bandwidth and capacity, and the three
links a weight update can take: within a host, across hosts, and between a chip and its host.

Datasheet entries give *dense* (no structured sparsity) peak matrix throughput per chip. Every
entry names the document its numbers come from. The host CPU is not in the table: it is measured
(:func:`measure_cpu`) with a jitted matmul, a jitted reduction and a NumPy copy, as the
benchmarks in ``benchmarks/`` measure their ceilings.

Units: FLOP/s, bytes/s, bytes, seconds. ``interconnect_bandwidth`` is the datasheet's per-chip
figure, *bidirectional* (NVLink 900 GB/s on H100 is 450 GB/s each way; TPU ICI figures are quoted
bidirectional too); :attr:`Accelerator.link_bandwidth` is one direction, the rate at which one
chip can send (or receive) a stream such as a weight update.

The link hierarchy (fields with defaults, so that descriptions written before they existed
still load):

- ``chips_per_host``: chips that share the within-host link (an HGX board's 8 GPUs on NVLink, a
  TPU host's chips on ICI). ``None``: one host holds any layout (the measured CPU, an older
  description), so every transfer takes the within-host link.
- ``network_bandwidth``: the across-host network per chip, *one direction*, bytes/s (a
  ConnectX-7 NIC per GPU at 400 Gb/s each way on HGX/DGX H100, H200, B200; Google's data
  center network (DCN) per TPU chip).
- ``host_link_bandwidth``: chip <-> host memory per chip, one direction, bytes/s (PCIe), the
  rate of the device-to-host and host-to-device copies of a host-staged weight update.
- ``figure_sources``: where each of these figures comes from, keyed by field name.

How a weight update is priced from them is in :mod:`rl_jax.sysmodel.weightsync`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_jax.sysmodel.errors import SysModelError

# Bytes per element of each dtype name used in the catalogue and in model shapes.
DTYPE_BYTES = {"float32": 4, "tfloat32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of :data:`DTYPE_BYTES`)."""
    if dtype not in DTYPE_BYTES:
        raise SysModelError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator chip (a GPU, a TPU chip, or the host CPU).

    Attributes:
      name: catalogue key, e.g. ``"h100"``.
      description: the exact part, e.g. ``"NVIDIA H100 SXM5 80GB"``.
      peak_flops: dense peak matrix throughput per dtype name, FLOP/s.
      memory_bandwidth: HBM (or DRAM) bandwidth, bytes/s.
      memory_capacity: HBM (or DRAM) capacity, bytes.
      interconnect_bandwidth: chip-to-chip bandwidth per chip, bidirectional, bytes/s.
      interconnect: name of that link (``"NVLink 4"``, ``"ICI"``, ``"memcpy"``).
      collective_latency_s: fixed cost of one small all-reduce across a tensor-parallel group,
        seconds. An estimate, not a datasheet figure (order of ten microseconds on NVLink/ICI).
      source: where the numbers come from (URL or "measured ...").
      chips_per_host: chips on one host's within-host link; ``None`` when one host holds any
        layout.
      network_bandwidth: across-host network per chip, one direction, bytes/s (``None``:
        unknown; needed when ``chips_per_host`` is set).
      network: name of that network (``"InfiniBand NDR (ConnectX-7)"``, ``"DCN"``).
      host_link_bandwidth: chip <-> host copy bandwidth per chip, one direction, bytes/s
        (``None``: not published).
      figure_sources: source of each link figure, keyed by field name.
    """

    name: str
    description: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_capacity: float
    interconnect_bandwidth: float
    interconnect: str
    collective_latency_s: float
    source: str
    chips_per_host: int | None = None
    network_bandwidth: float | None = None
    network: str = ""
    host_link_bandwidth: float | None = None
    figure_sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; an error names the dtypes this chip lists."""
        if dtype not in self.peak_flops:
            raise SysModelError(
                f"accelerator {self.name!r} has no {dtype} peak in its datasheet; choose one of "
                f"{sorted(self.peak_flops)}")
        return float(self.peak_flops[dtype])

    @property
    def link_bandwidth(self) -> float:
        """One-direction interconnect bandwidth per chip, bytes/s."""
        return self.interconnect_bandwidth / 2

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["peak_flops"] = dict(self.peak_flops)
        out["figure_sources"] = dict(self.figure_sources)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Accelerator":
        """An accelerator from :meth:`to_dict` output. The link-hierarchy fields are optional,
        so descriptions written before they existed (and measured ones) load unchanged."""
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise SysModelError(f"accelerator description lacks fields {missing}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: data[k] for k in known if k in data}
        name = data["name"]
        values["peak_flops"] = {str(k): float(v) for k, v in dict(data["peak_flops"]).items()}
        for key in ("memory_bandwidth", "memory_capacity", "interconnect_bandwidth"):
            values[key] = float(values[key])
            if values[key] <= 0:
                raise SysModelError(f"accelerator {name!r}: {key} must be > 0")
        for key in ("network_bandwidth", "host_link_bandwidth"):
            if values.get(key) is not None:
                values[key] = float(values[key])
                if values[key] <= 0:
                    raise SysModelError(f"accelerator {name!r}: {key} must be > 0 (or absent)")
        chips = values.get("chips_per_host")
        if chips is not None:
            if isinstance(chips, bool) or int(chips) != chips or chips < 1:
                raise SysModelError(f"accelerator {name!r}: chips_per_host must be an integer "
                                    f">= 1 (or absent), got {chips!r}")
            values["chips_per_host"] = int(chips)
            if values.get("network_bandwidth") is None:
                raise SysModelError(f"accelerator {name!r}: chips_per_host is set, so "
                                    "network_bandwidth (across hosts, per chip) is needed")
        values["figure_sources"] = {str(k): str(v) for k, v in
                                    dict(data.get("figure_sources") or {}).items()}
        return cls(**values)


TB, GB = 1e12, 1e9
GBIT = 1e9 / 8  # bytes/s in one Gb/s
_NVIDIA_NVLINK4_LATENCY = 10e-6
_TPU_ICI_LATENCY = 10e-6


def _hgx_links(system: str, url: str, datasheet: str) -> dict[str, Any]:
    """The links of an 8-GPU HGX/DGX board: one 400 Gb/s ConnectX-7 NIC per GPU for the compute
    fabric, and each GPU on a PCIe Gen5 x16 link to the host (128 GB/s both ways together)."""
    return dict(
        chips_per_host=8, network_bandwidth=400 * GBIT,
        network="InfiniBand NDR / RoCE, ConnectX-7 400 Gb/s per GPU",
        host_link_bandwidth=128 * GB / 2,
        figure_sources={
            "chips_per_host": f"{system}: 8 GPUs per system, {url}",
            "network_bandwidth": f"{system} datasheet: 8x single-port ConnectX-7 VPI, 400 Gb/s "
                                 f"InfiniBand/Ethernet (one per GPU), {url}",
            "host_link_bandwidth": f"{datasheet} (PCIe Gen5: 128 GB/s, both directions "
                                   "together; half of it each way)"})


def _tpu_links(chips: int, per_chip_gbit: float, url: str, network_note: str,
               host_note: str) -> dict[str, Any]:
    return dict(
        chips_per_host=chips, network_bandwidth=per_chip_gbit * GBIT,
        network="Google data center network (DCN)", host_link_bandwidth=None,
        figure_sources={"chips_per_host": f"{url} (chips per host)",
                        "network_bandwidth": f"{url} ({network_note})",
                        "host_link_bandwidth": f"not published ({host_note})"})

CATALOGUE: dict[str, Accelerator] = {
    "h100": Accelerator(
        name="h100", description="NVIDIA H100 SXM5 80GB",
        # Dense tensor-core figures (the datasheet's are with 2:4 sparsity, twice these);
        # float32 is the non-tensor-core rate, tfloat32 what XLA uses for f32 matmuls by default.
        peak_flops={"float32": 66.9e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12,
                    "float16": 989.4e12, "float8": 1978.9e12, "int8": 1978.9e12},
        memory_bandwidth=3.35 * TB, memory_capacity=80 * GB,
        interconnect_bandwidth=900 * GB, interconnect="NVLink 4",
        collective_latency_s=_NVIDIA_NVLINK4_LATENCY,
        source="NVIDIA H100 Tensor Core GPU datasheet, "
               "https://www.nvidia.com/en-us/data-center/h100/ (SXM5 column)",
        **_hgx_links("NVIDIA DGX H100", "https://www.nvidia.com/en-us/data-center/dgx-h100/",
                     "NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/")),
    "h200": Accelerator(
        name="h200", description="NVIDIA H200 SXM 141GB",
        # Same GH100 compute as H100 SXM; more and faster HBM3e.
        peak_flops={"float32": 66.9e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12,
                    "float16": 989.4e12, "float8": 1978.9e12, "int8": 1978.9e12},
        memory_bandwidth=4.8 * TB, memory_capacity=141 * GB,
        interconnect_bandwidth=900 * GB, interconnect="NVLink 4",
        collective_latency_s=_NVIDIA_NVLINK4_LATENCY,
        source="NVIDIA H200 Tensor Core GPU datasheet, "
               "https://www.nvidia.com/en-us/data-center/h200/ (SXM column)",
        **_hgx_links("NVIDIA DGX H200", "https://www.nvidia.com/en-us/data-center/dgx-h200/",
                     "NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/")),
    "h800": Accelerator(
        name="h800", description="NVIDIA H800 SXM5 80GB",
        # H100 SXM5 compute and memory with NVLink cut to 400 GB/s.
        peak_flops={"float32": 66.9e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12,
                    "float16": 989.4e12, "float8": 1978.9e12, "int8": 1978.9e12},
        memory_bandwidth=3.35 * TB, memory_capacity=80 * GB,
        interconnect_bandwidth=400 * GB, interconnect="NVLink 4 (400 GB/s)",
        collective_latency_s=_NVIDIA_NVLINK4_LATENCY,
        source="no NVIDIA datasheet page: the H100 SXM5 datasheet's figures "
               "(https://www.nvidia.com/en-us/data-center/h100/) with NVLink at 400 GB/s, as "
               "the export variant is described",
        **_hgx_links("HGX H800 (8 GPUs per board, as HGX H100)",
                     "https://www.nvidia.com/en-us/data-center/hgx/",
                     "assumed as the H100 board's PCIe Gen5 x16, "
                     "https://www.nvidia.com/en-us/data-center/h100/")),
    "h20": Accelerator(
        name="h20", description="NVIDIA H20 96GB (HGX H20)",
        # GH100 with the compute cut (FP16/BF16 dense 148 TFLOP/s, FP8 296) and HBM3 kept;
        # NVIDIA publishes no datasheet page for it.
        peak_flops={"float32": 44e12, "tfloat32": 74e12, "bfloat16": 148e12,
                    "float16": 148e12, "float8": 296e12, "int8": 296e12},
        memory_bandwidth=4.0 * TB, memory_capacity=96 * GB,
        interconnect_bandwidth=900 * GB, interconnect="NVLink 4",
        collective_latency_s=_NVIDIA_NVLINK4_LATENCY,
        source="no NVIDIA datasheet page; figures as listed at "
               "https://willitrunai.com/es/gpus/h20-96gb (96 GB HBM3, 4.0 TB/s, 148 TFLOPS "
               "FP16, 296 INT8, NVLink 900 GB/s) and the FP32/TF32 figures reported with "
               "them",
        **_hgx_links("HGX H20 (8 GPUs per board, as HGX H100)",
                     "https://www.nvidia.com/en-us/data-center/hgx/",
                     "assumed as the H100 board's PCIe Gen5 x16, "
                     "https://www.nvidia.com/en-us/data-center/h100/")),
    "b200": Accelerator(
        name="b200", description="NVIDIA B200 (HGX/DGX B200, 1000 W)",
        # Dense figures: half the sparse per-GPU numbers of the 8-GPU system datasheets; memory
        # is the usable 1,440 GB / 8 of DGX B200.
        peak_flops={"float32": 80e12, "tfloat32": 1.1e15, "bfloat16": 2.25e15,
                    "float16": 2.25e15, "float8": 4.5e15, "int8": 4.5e15},
        memory_bandwidth=8 * TB, memory_capacity=180 * GB,
        interconnect_bandwidth=1800 * GB, interconnect="NVLink 5",
        collective_latency_s=_NVIDIA_NVLINK4_LATENCY,
        source="NVIDIA DGX B200 datasheet, https://www.nvidia.com/en-us/data-center/dgx-b200/ "
               "and HGX B200 specifications, https://www.nvidia.com/en-us/data-center/hgx/",
        **_hgx_links("NVIDIA DGX B200", "https://www.nvidia.com/en-us/data-center/dgx-b200/",
                     "NVIDIA HGX B200 specifications, https://www.nvidia.com/en-us/data-center/"
                     "hgx/, and MLCommons inference v6.0 system nebius_b200_n1 (B200-SXM-180GB "
                     "on PCIe Gen5 x16), https://github.com/mlcommons/inference_results_v6.0")),
    "tpu_v5e": Accelerator(
        name="tpu_v5e", description="Google Cloud TPU v5e chip",
        peak_flops={"bfloat16": 197e12, "int8": 394e12},
        memory_bandwidth=819 * GB, memory_capacity=16 * GB,
        interconnect_bandwidth=400 * GB, interconnect="ICI (2D torus)",
        collective_latency_s=_TPU_ICI_LATENCY,
        source="Cloud TPU v5e documentation, https://cloud.google.com/tpu/docs/v5e "
               "(system architecture table)",
        **_tpu_links(8, 200 / 8, "https://cloud.google.com/tpu/docs/v5e",
                     "per-host NIC configuration 2 x 100 Gbps, over 8 chips per host",
                     "the v5e page gives no chip-to-host figure")),
    "tpu_v5p": Accelerator(
        name="tpu_v5p", description="Google Cloud TPU v5p chip",
        peak_flops={"bfloat16": 459e12, "int8": 918e12},
        memory_bandwidth=2765 * GB, memory_capacity=95 * GB,
        interconnect_bandwidth=1200 * GB, interconnect="ICI (3D torus)",
        collective_latency_s=_TPU_ICI_LATENCY,
        source="Cloud TPU v5p documentation, https://cloud.google.com/tpu/docs/v5p "
               "(system architecture table)",
        **_tpu_links(4, 50, "https://cloud.google.com/tpu/docs/v5p",
                     "data center network (DCN) bandwidth per chip: 50 Gbps; 4-chip VMs",
                     "the v5p page gives no chip-to-host figure")),
    "tpu_v6e": Accelerator(
        name="tpu_v6e", description="Google Cloud TPU v6e (Trillium) chip",
        peak_flops={"bfloat16": 918e12, "int8": 1836e12},
        memory_bandwidth=1640 * GB, memory_capacity=32 * GB,
        interconnect_bandwidth=800 * GB, interconnect="ICI (2D torus)",
        collective_latency_s=_TPU_ICI_LATENCY,
        source="Cloud TPU v6e documentation, https://cloud.google.com/tpu/docs/v6e "
               "(system architecture table)",
        **_tpu_links(8, 800 / 8, "https://cloud.google.com/tpu/docs/v6e",
                     "per-host NIC configuration 4 x 200 Gbps, over 8 chips per host",
                     "the v6e page says PCIe Gen5 but not the lane count")),
}

# Alternative spellings accepted by get_accelerator.
ALIASES = {"v5e": "tpu_v5e", "v5p": "tpu_v5p", "v6e": "tpu_v6e", "trillium": "tpu_v6e",
           "tpu-v5e": "tpu_v5e", "tpu-v5p": "tpu_v5p", "tpu-v6e": "tpu_v6e"}


def accelerator_names() -> list[str]:
    """Names :func:`get_accelerator` accepts: the catalogue plus ``"cpu"`` (measured)."""
    return sorted(CATALOGUE) + ["cpu"]


def get_accelerator(name: str, *, cpu_cache: str | os.PathLike | None = None) -> Accelerator:
    """A catalogue entry by name (case-insensitive), ``"cpu"`` (measured here, see
    :func:`measure_cpu`), or a path to a JSON file holding :meth:`Accelerator.to_dict` output."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in CATALOGUE:
        return CATALOGUE[key]
    if key == "cpu":
        return measure_cpu(cache=cpu_cache)
    if key.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise SysModelError(f"accelerator file {name} does not exist")
        try:
            return Accelerator.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError, KeyError) as e:
            raise SysModelError(f"accelerator file {name} is not a valid description: {e}")
    raise SysModelError(f"unknown accelerator {name!r}; known: {', '.join(accelerator_names())}"
                        " (or a .json file with an accelerator description)")


# ---- the host CPU, measured ---------------------------------------------------------------------

def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (compiles)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu(*, matmul_size: int = 1024, read_mib: int = 256, repeats: int = 5,
                cache: str | os.PathLike | None = None) -> Accelerator:
    """Measures this host's ceilings with JAX's CPU backend (imported here, not at module level).

    - peak FLOP/s: best of ``repeats`` jitted ``n×n @ n×n`` matmuls (float32 and bfloat16);
    - memory bandwidth: a jitted column sum reading ``read_mib`` MiB (decode mostly reads);
    - interconnect: a NumPy copy of the same buffer (what a shared-memory weight transfer
      between two processes on this host can at best reach), counted once per direction; the
      same copy is the host link (a CPU device's memory is the host's);
    - capacity: physical memory.

    ``cache``: a JSON file; read when it exists, written after a measurement.
    """
    if cache is not None and Path(cache).is_file():
        return Accelerator.from_dict(json.loads(Path(cache).read_text()))
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.devices("cpu")[0]
    peak = {}
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        a = jax.device_put(jnp.ones((matmul_size, matmul_size), dtype), cpu)
        matmul = jax.jit(lambda x: x @ x)
        seconds = _best_seconds(lambda: jax.block_until_ready(matmul(a)), repeats)
        peak[name] = 2 * matmul_size ** 3 / seconds
    x = jax.device_put(jnp.ones((read_mib * 2 ** 20 // 4 // 1024, 1024), jnp.float32), cpu)
    read = jax.jit(lambda x: jnp.sum(x, axis=0))
    read_s = _best_seconds(lambda: jax.block_until_ready(read(x)), repeats)
    host = np.ones(read_mib * 2 ** 20 // 4, np.float32)
    dest = np.empty_like(host)
    copy_s = _best_seconds(lambda: np.copyto(dest, host), repeats)
    try:
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        capacity = 8 * GB
    acc = Accelerator(
        name="cpu", description=f"host CPU ({os.cpu_count()} cores, {cpu.device_kind})",
        peak_flops=peak, memory_bandwidth=x.nbytes / read_s, memory_capacity=capacity,
        interconnect_bandwidth=2 * host.nbytes / copy_s, interconnect="memcpy",
        collective_latency_s=20e-6, host_link_bandwidth=host.nbytes / copy_s,
        figure_sources={"host_link_bandwidth": "measured: NumPy copy (device memory is host "
                                               "memory)"},
        source=f"measured on this host {time.strftime('%Y-%m-%d %H:%M')}: jitted {matmul_size}^2 "
               f"matmul, {read_mib} MiB jitted reduction, NumPy copy")
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        Path(cache).write_text(json.dumps(acc.to_dict(), indent=1))
    return acc
