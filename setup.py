"""Installs the `megatron` package: a Megatron-style 3D-parallel GPT pretraining codebase."""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md")
SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "jinja2>=3.0", "httpx", "openai>=1.0"]
EVAL = ["lm-eval[api]>=0.4.5", "accelerate"]  # [api]: its local-completions model
WANDB = ["wandb"]
DATA = ["pyarrow>=12", "datasets"]  # Parquet and datasets.save_to_disk inputs to preprocessing
PROGRESS = ["tqdm"]  # progress bars when attached to a terminal (plain lines otherwise)
DEMO = ["matplotlib"]  # the loss plot of `make demo` (tools/plot_losses.py)
FP8 = ["torchao==0.18.0"]  # --fp8-format (built against torch 2.11; its float8 training is Python)
# --kernel-library liger (pure Triton; its own requirements are torch and triton only)
LIGER = ["liger-kernel>=0.8.5; platform_system == 'Linux'"]
FT = ["torchft>=0.2"]  # --fault-tolerance: replica groups, its lighthouse (a Rust binary) included

setup(
    name="megatron-3d",
    version="0.1.0",
    description="Megatron-style GPT pretraining with tensor x pipeline x data parallelism",
    long_description=README.read_text(encoding="utf-8") if README.exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]),
    # GPT-2's vocab.json / merges.txt (OpenAI, MIT): --tokenizer-type GPT2BPETokenizer offline
    package_data={"megatron.data": ["assets/gpt2/*"]},
    # Ranges only: a GPU user keeps the CUDA build of torch they already have.
    install_requires=[
        "torch>=2.3",
        "numpy>=1.24",
        "pyyaml",  # run configs: -c run.yaml, --print-config, SAVE/run_config.yaml
        "regex",
        "tensorboard",
        "tokenizers>=0.15",
        "tiktoken>=0.5",  # the fast engine for GPT-2 BPE preprocessing (checked against HF)
    ],
    extras_require={
        "dev": [
            "pytest>=7",
            "pytest-timeout",
            "pytest-xdist",  # make test: two workers, one test file each at a time
            "ruff",
            "sentencepiece",
            "transformers",  # checks HF exports (tests/checkpoint/test_convert_checkpoint.py)
            "safetensors",  # HF weight files (megatron/models/gpt/hf.py)
            "triton; platform_system == 'Linux'",  # kernel tests run in its CPU interpreter
            *LIGER,  # its ops are tested against ours in the interpreter
            *SERVE,
            *EVAL,
            *WANDB,
            *DATA,
            *PROGRESS,
            *DEMO,
            *FP8,  # the fp8 tests run torchao's emulation on the CPU
            *FT,
        ],
        # tools/run_text_generation_server.py (and its tests: httpx, openai)
        "serve": SERVE,
        # tools/lm_eval.py; accelerate for lm-eval's own hf model (the parity test)
        "eval": EVAL,
        # --wandb-project (imported only when given)
        "wandb": WANDB,
        "data": DATA,
        "progress": PROGRESS,
        "demo": DEMO,
        # --fp8-format (imported only when given)
        "fp8": FP8,
        "liger": LIGER,
        # --fault-tolerance (imported only then)
        "ft": FT,
        # DeepSpeed must be installed after torch with --no-build-isolation (see README).
        "deepspeed": ["deepspeed>=0.14"],
    },
)
