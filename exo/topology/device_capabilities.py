"""What a node offers the ring: memory (MiB) decides its share of layers; FLOPS are informational."""
import asyncio
import platform
import subprocess
from typing import Any

import psutil
from pydantic import BaseModel

TFLOPS = 1.00


class DeviceFlops(BaseModel):
  fp32: float
  fp16: float
  int8: float

  def __str__(self):
    return f"fp32: {self.fp32 / TFLOPS:.2f} TFLOPS, fp16: {self.fp16 / TFLOPS:.2f} TFLOPS, int8: {self.int8 / TFLOPS:.2f} TFLOPS"

  def to_dict(self):
    return self.model_dump()


class DeviceCapabilities(BaseModel):
  model: str
  chip: str
  memory: int  # MiB
  flops: DeviceFlops

  def __str__(self):
    return f"Model: {self.model}. Chip: {self.chip}. Memory: {self.memory}MB. Flops: {self.flops}"

  def model_post_init(self, __context: Any) -> None:
    if isinstance(self.flops, dict):
      self.flops = DeviceFlops(**self.flops)

  def to_dict(self):
    return {"model": self.model, "chip": self.chip, "memory": self.memory, "flops": self.flops.to_dict()}


UNKNOWN_DEVICE_CAPABILITIES = DeviceCapabilities(model="Unknown Model", chip="Unknown Chip", memory=0, flops=DeviceFlops(fp32=0, fp16=0, int8=0))

# Peak TFLOPS by chip name, for the UI only (partitioning ignores them).
CHIP_FLOPS = {
  "Apple M1": DeviceFlops(fp32=2.29, fp16=4.58, int8=9.16),
  "Apple M2": DeviceFlops(fp32=3.55, fp16=7.10, int8=14.20),
  "Apple M3": DeviceFlops(fp32=3.55, fp16=7.10, int8=14.20),
  "Apple M4": DeviceFlops(fp32=4.26, fp16=8.52, int8=17.04),
  "NVIDIA GEFORCE RTX 4090": DeviceFlops(fp32=82.58, fp16=165.16, int8=330.32),
  "NVIDIA GEFORCE RTX 3090": DeviceFlops(fp32=35.6, fp16=71.2, int8=142.4),
  "NVIDIA A100 80GB PCIE": DeviceFlops(fp32=19.5, fp16=312.0, int8=624.0),
  "NVIDIA H100": DeviceFlops(fp32=51.22, fp16=756.0, int8=1513.0),
  "NVIDIA H200": DeviceFlops(fp32=67.0, fp16=989.0, int8=1979.0),
}


def _zero_flops() -> DeviceFlops:
  return DeviceFlops(fp32=0, fp16=0, int8=0)


def _nvidia_gpu():
  """(name, VRAM MiB) of the first NVIDIA GPU, via NVML when available."""
  try:
    import pynvml
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    return name, pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20
  except Exception:
    return None


async def linux_device_capabilities(device_name: str = "CPU") -> DeviceCapabilities:
  gpu = _nvidia_gpu()
  if gpu is not None:
    name = gpu[0].rsplit(" ", 1)[0] if gpu[0].split()[-1].endswith("GB") else gpu[0]
    chip = name.upper()
    return DeviceCapabilities(model=f"Linux Box ({chip})", chip=chip, memory=gpu[1], flops=CHIP_FLOPS.get(chip, _zero_flops()))
  return DeviceCapabilities(model=f"Linux Box (Device: {device_name})", chip=f"Unknown Chip (Device: {device_name})",
                            memory=psutil.virtual_memory().total // 2**20, flops=_zero_flops())


async def mac_device_capabilities() -> DeviceCapabilities:
  """From `system_profiler SPHardwareDataType` (run off the event loop: it takes about a second)."""
  try:
    out = (await asyncio.to_thread(subprocess.check_output, ["system_profiler", "SPHardwareDataType"])).decode()
    info = dict(line.strip().split(": ", 1) for line in out.splitlines() if ": " in line)
    chip, model = info.get("Chip", "Unknown Chip"), info.get("Model Name", "Unknown Model")
    memory = int(info.get("Memory", "0 GB").split()[0]) * 1024
  except Exception:
    chip, model, memory = "Unknown Chip", "Unknown Model", psutil.virtual_memory().total // 2**20
  return DeviceCapabilities(model=model, chip=chip, memory=memory, flops=CHIP_FLOPS.get(chip, _zero_flops()))


async def device_capabilities(device_name: str = "CPU") -> DeviceCapabilities:
  """Capabilities of this machine; `device_name` is what the engine runs on (e.g. CPU, CLANG, CUDA)."""
  if platform.system() == "Darwin":
    return await mac_device_capabilities()
  if platform.system() == "Linux":
    return await linux_device_capabilities(device_name)
  return DeviceCapabilities(model="Unknown Device", chip="Unknown Chip", memory=psutil.virtual_memory().total // 2**20, flops=_zero_flops())


def measure_gflops(rounds: int = 6, round_s: float = 0.02, pause_s: float = 0.05) -> float:
  """This process's float32 matrix-product speed on the cores it may use (GFLOP/s, three significant digits): the
  fastest of back-to-back products of a decode step's shape, `rounds` rounds of `round_s` each, `pause_s` apart, so
  that a moment of contention (a process starting beside this one) counts for nothing unless it lasts the whole
  third of a second. Placement cuts a pipeline's layers by it."""
  import time

  import numpy as np
  rows, width = 32, 768
  a, b = np.ones((rows, width), np.float32), np.ones((width, width), np.float32)
  a @ b
  best = float("inf")
  for round_ in range(rounds):
    if round_:
      time.sleep(pause_s)
    start = time.perf_counter()
    while time.perf_counter() - start < round_s:
      begin = time.perf_counter()
      a @ b
      best = min(best, time.perf_counter() - begin)
  gflops = 2 * rows * width * width / best / 1e9
  return float(f"{gflops:.3g}")
