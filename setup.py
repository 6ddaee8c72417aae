from setuptools import find_packages, setup

setup(
    name="megatron-dcp",
    version="0.1.0",
    description="Dynamic Context Parallelism (DCP) for NVIDIA Megatron-Core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dcp", "megatron_dcp.*"]),
    install_requires=["torch", "numpy", "matplotlib", "megatron-core>=0.19,<0.20"],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "test": ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis"],
    },
    entry_points={"console_scripts": ["megatron-dcp=megatron_dcp.cli:main"]},
)
