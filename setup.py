"""Packaging of megatron_dcp (import name) as ``megatron-dcp``.

On Python 3.11, install megatron-core 0.19.2 first with ``--ignore-requires-python --no-deps``
and this package with ``--no-deps`` (see scripts/setup_env.sh): the 0.19.x wheels declare
Python ≥3.12.
"""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md").read_text(encoding="utf-8")

setup(
    name="megatron-dcp",
    version="0.1.0",
    description="Dynamic Context Parallelism (DCP) for NVIDIA Megatron-Core",
    long_description=README,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dcp", "megatron_dcp.*"]),
    install_requires=[
        "torch",
        "numpy",
        "megatron-core>=0.19,<0.20",
        "typing_extensions",  # megatron.training needs typing.override on Python 3.11
        "psutil",  # megatron.training's checkpoint writer
        "tqdm>=4.70.1",  # the progress of long commands (megatron_dcp/tools/progress.py)
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "plot": ["matplotlib"],  # megatron-dcp simulate --plot, the quick-start's plan picture
        "mamba": ["einops"],
        # verl's dynamic-CP path (tests/integration/test_verl_dcp.py, docs/rl.md): install
        # verl itself with --no-deps (its full requirements pull GPU packages), then these.
        "verl": [
            "verl==0.9.1",
            "tensordict==0.10.0",
            "pyvers>=0.1,<0.2",
            "orjson",
            "importlib_metadata",
            "ray",
            "omegaconf",
            "cloudpickle",
            "transformers<5.11",
            "codetiming",
            "peft",
            "datasets",
        ],
        "test": ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "einops", "pyyaml"],
    },
    entry_points={
        "console_scripts": [
            "megatron-dcp=megatron_dcp.tools.cli.main:main",
            "megatron-dcp-pretrain-gpt=megatron_dcp.pretrain_gpt:main",
            "megatron-dcp-pretrain-mamba=megatron_dcp.pretrain_mamba:main",
            "megatron-dcp-pretrain-vlm=megatron_dcp.pretrain_vlm:main",
        ]
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
