"""llama.cpp's server on the embedded model's GGUF, the reference a user would compare exo with. It is not built
here: build it from llama.cpp's sources (the llama-cpp-python sdist carries them under vendor/llama.cpp:
`cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server`) and put it on PATH."""
import asyncio
import shutil
import subprocess
import time
from pathlib import Path
from typing import List, Optional

import aiohttp

from bench import free_port


def embedded_gguf() -> Path:
  from exo.download.shard_download import embedded_model_path
  return next(Path(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")).parent.glob("*.gguf"))


def available() -> bool:
  return shutil.which("llama-server") is not None


class LlamaServer:
  """`llama-server` on loopback; `args` are its own flags (slots, threads, context)."""

  def __init__(self, log_dir: Path, args: Optional[List[str]] = None, pin=None, gguf: Optional[Path] = None):
    self.port, self.log_dir, self.proc = free_port(), log_dir, None
    self.gguf = gguf or embedded_gguf()
    self.args = ["-c", "8192"] if args is None else args
    self.pin = pin  # run in the child before exec (e.g. to pin it to cores)

  async def __aenter__(self) -> "LlamaServer":
    log = open(self.log_dir / "llama-server.log", "ab")
    self.proc = subprocess.Popen(["llama-server", "-m", str(self.gguf), "--port", str(self.port), "--host", "127.0.0.1", *self.args],
                                 stdout=log, stderr=subprocess.STDOUT, preexec_fn=self.pin)
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as session:
      while True:
        try:
          async with session.get(f"http://127.0.0.1:{self.port}/health") as r:
            if r.status == 200:
              return self
        except aiohttp.ClientError:
          pass
        if self.proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"llama-server did not start; see {self.log_dir / 'llama-server.log'}")
        await asyncio.sleep(0.25)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}/v1/chat/completions"

  async def __aexit__(self, *exc) -> None:
    self.proc.terminate()
    self.proc.wait(20)


def resident_mib(pid: int) -> float:
  """A process's resident memory (VmRSS), MiB."""
  for line in Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  raise RuntimeError(f"no VmRSS for {pid}")
