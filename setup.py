from setuptools import find_packages, setup

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
    install_requires=[
        "fairseq-fixed",
        "torch",
        "torchaudio",
        "pyyaml",
        "sacrebleu",
        "sentencepiece",
    ],
)
