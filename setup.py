import os
import shutil

from setuptools import find_packages, setup

DEFAULT_CUDA_ARCHS = "8.0;9.0"


def cuda_wanted(torch, cpp_extension):
    """Build the CUDA kernels when nvcc and a CUDA build of torch are present."""
    if os.environ.get("LOCAL_ATTN_NO_CUDA") == "1" or torch.version.cuda is None:
        return False
    home = cpp_extension.CUDA_HOME
    return home is not None and os.path.exists(os.path.join(home, "bin", "nvcc"))


def choose_cuda_archs(torch):
    # Without a GPU to ask, torch would build for every arch it knows; pick the usual ones.
    archs = os.environ.get("LOCAL_ATTN_CUDA_ARCH_LIST")
    if archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    elif not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS


def banded_attention_extension():
    """local_attn_fairseq._banded_C: the banded attention kernels (csrc/), or nothing.

    The CPU kernels are always built; the CUDA ones when nvcc and a CUDA torch exist and
    LOCAL_ATTN_NO_CUDA is not 1. LOCAL_ATTN_NO_EXTENSION=1 builds nothing: the operator then
    runs its pure-PyTorch implementation.
    """
    if os.environ.get("LOCAL_ATTN_NO_EXTENSION") == "1":
        return [], {}
    if not os.environ.get("CUDA_HOME") and shutil.which("nvcc", path="/usr/local/cuda/bin"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # torch guesses wrong from a wrapper nvcc
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # read without torch (an sdist, say): the op falls back to PyTorch
        return [], {}
    sources = [
        "csrc/banded_attention.cpp",
        "csrc/banded_attention_autograd.cpp",
        "csrc/banded_attention_cpu.cpp",
        "csrc/mechanisms_cpu.cpp",
        "csrc/projections_cpu.cpp",
    ]
    headers = ["csrc/banded_attention.h", "csrc/banded_cpu_kernels.h", "csrc/operator_autograd.h"]
    # -fopenmp: at::parallel_for is header-only and runs serially without it; the AVX2 copy of
    # the CPU kernels is chosen at run time, so no -march flag is needed.
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
    kwargs = dict(
        name="local_attn_fairseq._banded_C",
        sources=sources,
        depends=headers,
        extra_link_args=["-fopenmp"],
        extra_compile_args={"cxx": cxx_flags},
    )
    if cuda_wanted(torch, cpp_extension):
        choose_cuda_archs(torch)
        # The tensor-core kernels need sm_80 or newer; DEFAULT_CUDA_ARCHS are 8.0 and 9.0.
        kwargs["sources"] = sources + [
            "csrc/banded_attention_cuda.cu",
            "csrc/banded_attention_tensor_core.cu",
        ]
        cuda_macros = ["-DLOCAL_ATTN_WITH_CUDA", "-DLOCAL_ATTN_WITH_TENSOR_CORE"]
        kwargs["extra_compile_args"] = {
            "cxx": cxx_flags + cuda_macros,
            "nvcc": ["-O3"] + cuda_macros,
        }
        extension = cpp_extension.CUDAExtension(**kwargs)
    else:
        extension = cpp_extension.CppExtension(**kwargs)
    return [extension], {"build_ext": cpp_extension.BuildExtension}


EXT_MODULES, CMDCLASS = banded_attention_extension()

setup(
    name="local_attn_fairseq",
    version="0.1.0",
    description="Local attention for fairseq: fixed local heads with tied Q/K, Gaussian localness, "
    "differentiable windows, head gates, and a banded attention kernel",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["local_attn_fairseq", "local_attn_fairseq.*"])
    + ["local_attn_fairseq.configs"],
    # The locality presets live in configs/ at the top of the repository and are installed
    # inside the package, where local_attn_fairseq.locality.spec looks for them first.
    package_dir={"local_attn_fairseq.configs": "configs"},
    package_data={"local_attn_fairseq.configs": ["locality/*.yaml"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    entry_points={
        "console_scripts": [
            "local-attn-analyze = local_attn_fairseq.analysis.cli:main",
            "local-attn-recipe = local_attn_fairseq.recipes.cli:main",
        ],
    },
    install_requires=[
        "fairseq-fixed",
        "torch",
        "torchaudio",
        "pyyaml",
        "sacrebleu",
        "sacremoses",
        "sentencepiece",
        "soundfile",
        "matplotlib",
        "tqdm",
    ],
    # cuDNN's banded attention (the cudnn-band route of ops/): GPU machines only
    extras_require={"cudnn": ["nvidia-cudnn-frontend==1.23.0"]},
)
