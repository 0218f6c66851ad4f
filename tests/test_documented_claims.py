"""Claims of README.md and docs/ that no other test checked, each checked here where it is made."""

import glob
import os
import re

import pytest
import torch

from local_attn_fairseq.experiments import kernel_results
from local_attn_fairseq.locality.spec import HeadSpec
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention

from .conftest import REPO, TRAIN, USER_DIR, fairseq_cli
from .test_readme_commands import FENCE, LINK, github_anchors, read
from .models.test_combined_mechanisms import COMBINED_MODEL, COMBINED_OPTIONS


def test_memory_efficient_fp16_trains_the_combined_model_on_the_cpu(tiny_data, tmp_path):
    """docs/distributed_and_precision.md, "Mixed precision": fairseq's --memory-efficient-fp16
    (float16 weights, no float32 copy) trains the model holding every mechanism on the CPU."""
    proc = fairseq_cli(
        "fairseq-train", tiny_data / "bin", "--user-dir", USER_DIR, *COMBINED_MODEL, *TRAIN,
        *COMBINED_OPTIONS, "--max-update", 2, "--save-dir", tmp_path, "--cpu",
        "--memory-efficient-fp16", "--disable-validation",
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "num_updates 2" in log and "loss_scale 128" in log, log[-3000:]
    assert "overflow" not in log and " nan" not in log.lower()
    checkpoint = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert checkpoint["optimizer_history"][-1]["optimizer_name"] == "MemoryEfficientFP16Optimizer"
    weights = [w for w in checkpoint["model"].values() if w.is_floating_point()]
    assert weights and all(torch.isfinite(w).all() for w in weights)


def package_map_block():
    with open(os.path.join(REPO, "docs", "package_map.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split("```\n")[1]  # the folders' block, the page's first


def test_the_package_map_names_every_module_and_no_other():
    """docs/package_map.md, "The folders": every module of the package is named (a ``*_cli``
    module of the analyses beside its module of maths), and every file named exists."""
    block = package_map_block()
    named = set(re.findall(r"[\w./*]+\.py\b", block))
    package = os.path.join(REPO, "local_attn_fairseq")
    modules = {
        os.path.relpath(os.path.join(folder, name), REPO)
        for folder, _, files in os.walk(package)
        for name in files
        if name.endswith(".py") and not (name == "__init__.py" and folder != package)
    }
    basenames = {os.path.basename(m) for m in named}
    missing = [
        m for m in sorted(modules)
        if os.path.basename(m) not in basenames
        and not (m.endswith("_cli.py") and "*_cli.py" in block
                 and os.path.basename(m).replace("_cli.py", ".py") in basenames)
    ]  # fmt: skip
    assert not missing, f"modules the package map does not name: {missing}"
    module_names = {os.path.basename(m) for m in modules}
    gone = [
        n for n in sorted(named)
        if "*" not in n and os.path.basename(n) not in module_names
        and not os.path.exists(os.path.join(REPO, n))
    ]  # fmt: skip
    assert not gone, f"files the package map names that do not exist: {gone}"


PAGES = sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "docs", "*.md"))
    + [os.path.join(REPO, "benchmarks", "README.md")]
)


@pytest.mark.parametrize("page", PAGES)
def test_every_link_of_the_docs_points_at_a_file_and_heading_that_exist(page):
    """What the README's and the index's links are checked for (test_readme_commands), on every
    page: a reader who follows a link finds the page and the heading it names."""
    broken = []
    for target in LINK.findall(FENCE.sub("", read(page))):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(REPO, resolved)):
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in github_anchors(resolved):
            broken.append(f"{target}: {resolved} has no heading #{anchor}")
    assert not broken, f"{page}: " + "; ".join(broken)


@pytest.mark.parametrize(
    "heads",
    [
        [HeadSpec("global")] * 4,
        [HeadSpec("global", gaussian=True)] * 4,
        [HeadSpec("global", window="mw")] * 4,
    ],
    ids=["global", "gaussian", "mw"],
)
def test_torch_func_grad_through_layers_on_pytorchs_operations(monkeypatch, heads):
    """docs/banded_attention.md, "Second derivatives": with LOCAL_ATTN_MECHANISM_IMPL=torch,
    torch.func.grad through a layer of global, Gaussian or dynamic-window heads gives autograd's
    gradient (the C++ operators, which refuse functorch, are then out of the call)."""
    monkeypatch.setenv("LOCAL_ATTN_MECHANISM_IMPL", "torch")
    torch.manual_seed(0)
    attn = LocalMultiheadAttention(16, 4, head_specs=heads, self_attention=True)
    attn.bind_qk_owners([attn])
    x = torch.randn(60, 2, 16)

    def loss(x):
        return attn(x, x, x, need_weights=False)[0].sin().sum()

    expected = torch.autograd.grad(loss(x.requires_grad_()), x)[0]
    torch.testing.assert_close(torch.func.grad(loss)(x.detach()), expected)


def test_the_gpu_kernel_table_is_the_committed_records_table():
    """docs/banded_attention_gpu.md, "Kernel cells as data": the table is what
    ``benchmarks/results_table.py benchmarks/results/h200_bf16_*.json`` makes of the committed
    records, every row and figure."""
    records = kernel_results.load_files(
        sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", "h200_bf16_*.json")))
    )
    expected = kernel_results.kernel_table(records).strip().splitlines()
    page = read(os.path.join("docs", "banded_attention_gpu.md")).splitlines()
    start = page.index(expected[0])  # the header line naming the GPU, torch and day
    assert page[start : start + len(expected)] == expected
