import re

from setuptools import find_packages, setup

# One version, mpfp16.__version__ (CHANGELOG.md lists the releases).
VERSION = re.search(r'^__version__ = "([^"]+)"', open("mpfp16/__init__.py", encoding="utf-8").read(), re.M).group(1)

LIGHTNING = ["lightning>=2.4"]
TRANSFORMERS = ["transformers==5.23.0", "accelerate==1.15.0"]
TORCHAO = ["torchao==0.18.0"]
PEFT = ["peft>=0.21,<0.22"]  # the suite tests 0.21.0
TIMM = ["timm>=1.0.31,<1.1"]  # the suite tests 1.0.31

setup(
    name="mpfp16",
    version=VERSION,
    description="A small, exact fp16/bf16 mixed-precision trainer for PyTorch: fp32 master "
                "weights, loss scaling, fp16 gradient allreduce, exact resume.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpfp16", "mpfp16.*"]),
    package_data={"mpfp16.stores": ["native.cpp"]},  # the C++ kernels, built at first use
    python_requires=">=3.11",  # the fused kernels name their code objects with co_qualname
    # torch is not pinned: install the build you want first (README); pip then keeps it.
    install_requires=["torch>=2.6", "torchvision>=0.21", "numpy", "tqdm"],
    # lightning: mpfp16.integrations.lightning (the Trainer and Fabric plugins); transformers:
    # mpfp16.integrations.transformers (MPFP16Trainer); torchao: its low-bit optimizers as the
    # inner optimizer. The versions the suite tests are pinned. dev: the test suite, which
    # tests all three.
    extras_require={"lightning": LIGHTNING, "transformers": TRANSFORMERS, "torchao": TORCHAO, "peft": PEFT, "timm": TIMM,
                    "dev": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "hypothesis", "matplotlib",
                            "import-linter"] + LIGHTNING + TRANSFORMERS + TORCHAO
                            + ["peft==0.21.0", "timm==1.0.31"]},
    license="BSD-3-Clause",
)
