from setuptools import find_packages, setup

setup(
    name="mpfp16",
    version="0.1.0",
    description="A small, exact fp16/bf16 mixed-precision trainer for PyTorch: fp32 master "
                "weights, loss scaling, fp16 gradient allreduce, exact resume.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpfp16", "mpfp16.*"]),
    package_data={"mpfp16.stores": ["native.cpp"]},  # the C++ kernels, built at first use
    python_requires=">=3.11",  # the fused kernels name their code objects with co_qualname
    # torch is not pinned: install the build you want first (README); pip then keeps it.
    install_requires=["torch>=2.6", "torchvision>=0.21", "numpy", "tqdm"],
    # lightning: mpfp16.integrations.lightning (the Trainer and Fabric plugins); dev: the test suite, which tests it.
    extras_require={"lightning": ["lightning>=2.4"],
                    "dev": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "hypothesis", "matplotlib",
                            "import-linter", "lightning>=2.4"]},
    license="BSD-3-Clause",
)
