from setuptools import find_packages, setup

install_requires = [
  "numpy>=1.26,<3",
  "gguf>=0.10,<1",
  "tokenizers>=0.19,<1",
  "jinja2>=3.1,<4",
  "huggingface_hub>=0.24,<3",
  "grpcio>=1.85.1,<2",
  "protobuf>=7.35.1,<8",
  "aiohttp>=3.9,<4",
  "pluggy>=1.5,<2",
  "pydantic>=2.5,<3",
  "psutil>=5.9,<8",
  "prometheus-client>=0.17,<1",
  "rich>=13,<16",
  "uvloop>=0.19,<1; sys_platform!='win32'",
  "llguidance>=1.0,<2",  # constrained decoding: response_format and tool calls (exo/inference/grammar.py)
  "jsonschema>=4.18,<5",  # checks the schemas requests send before they are admitted
]

extras_require = {
  "tinygrad": ["tinygrad>=0.10,<0.12"],
  "mlx": ["mlx[cpu]>=0.26.5,<1; platform_system=='Linux'", "mlx>=0.26.5,<1; platform_system=='Darwin'"],
  "bench": ["matplotlib>=3.7,<4"],
  # mlx-lm: tests convert checkpoints with its converter and compare with its generate (never a runtime dependency)
  "test": ["pytest>=8,<10", "pytest-timeout>=2.3,<3", "pytest-xdist>=3.5,<4", "pytest-asyncio>=0.24,<2", "openai>=1.66,<4", "grpcio-tools==1.85.1", "safetensors>=0.4,<1", "playwright>=1.40,<2",
           "mlx-lm>=0.28,<1",
           # unmodified clients of structured output and tool calls (tests/test_structured_output.py)
           "langchain-openai>=1.0,<2", "instructor>=1.10,<2", "pydantic-ai-slim[openai]>=1.0,<3",
           # unmodified clients of the other dialects (tests/test_api_dialects.py); openai's Responses API came in 1.66
           "anthropic>=0.40,<3", "ollama>=0.5,<1"],
}

setup(
  name="exo",
  version="0.0.1",
  description="Run one language model across several ordinary machines, serving many users at once",
  packages=find_packages(include=["exo", "exo.*"]),
  package_data={"exo": ["tinychat/**/*", "networking/grpc/*.proto", "inference/numpy/kernels_c/*.c", "inference/numpy/kernels_c/*.h"]},
  include_package_data=True,
  python_requires=">=3.11",
  install_requires=install_requires,
  extras_require=extras_require,
  entry_points={"console_scripts": ["exo = exo.main:run"]},
)
