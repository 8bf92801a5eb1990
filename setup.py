"""Ternion: Megatron-style 3D-parallel pretraining on PyTorch."""
from setuptools import find_packages, setup

setup(
    name="ternion",
    version="0.1.0",
    description="Data x tensor x pipeline parallel pretraining of GPT and Llama models on PyTorch",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["engine", "engine.*", "kernels", "kernels.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "tensorboard",
        "safetensors",
        "matplotlib",
        "tqdm",
        # The kernels are tested in Triton's interpreter on 3.6 (torch 2.11's) and 3.9 (the newest): `make
        # test-triton`; 3.5's interpreter cannot run any kernel (its own patching fails).
        'triton>=3.6,<3.10; platform_system == "Linux" and platform_machine == "x86_64"',
    ],
    extras_require={
        "gpu": ["flash-attn"],
        # megatron-core: the reference tests/test_megatron_data.py compares the data order with (CPU dataset code).
        # pytest-xdist: `make test` runs two workers (Makefile).
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "transformers", "megatron-core==0.16.1"],
    },
)
