"""The host-overhead benchmark: it times the real calls, and its script prints every row."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention

from local_attn_fairseq.experiments import host_overhead
from local_attn_fairseq.experiments.measurement import ForwardBackward
from local_attn_fairseq.modules.local_multihead_attention import LocalMultiheadAttention
from local_attn_fairseq.ops.banded_attention import banded_attention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "host_overhead.py")
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rows(one_torch_thread):
    return {row.kind.name: row for row in host_overhead.build_rows(host_overhead.ROW_NAMES, CPU)}


def direct_call(module, x, padding=None):
    return module(x, x, x, key_padding_mask=padding, need_weights=False)[0]


def test_the_banded_row_times_the_operator_and_sdpa_on_the_same_inputs(rows):
    row = rows["banded"]
    q, k, v = row.ours.leaves
    assert q.shape == host_overhead.BANDED_SHAPE and row.peer.leaves == row.ours.leaves
    window = host_overhead.BANDED_WINDOW
    torch.testing.assert_close(row.ours.forward(), banded_attention(q, k, v, window, window))
    torch.testing.assert_close(row.peer.forward(), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("name", [n for n in host_overhead.ROW_NAMES if n != "banded"])
def test_each_module_row_times_the_module_fairseq_builds(rows, name):
    row = rows[name]
    module, x = row.ours.module, row.ours.leaves[0]
    assert isinstance(module, LocalMultiheadAttention) and module.training
    assert x.shape == (host_overhead.LENGTH, host_overhead.BATCH, host_overhead.EMBED_DIM)
    # the call gives the module's own output (gates sample anew each call: same seed, same draw)
    torch.manual_seed(1)
    timed = row.ours.forward()
    torch.manual_seed(1)
    torch.testing.assert_close(timed, direct_call(module, x))
    # its backward reaches the input and every parameter the module trains ...
    ForwardBackward(row.ours.forward, leaves=())()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())
    # ... and a timed call drops those gradients, so that the next one assigns them anew
    row.ours.training_call()()
    assert x.grad is None and all(p.grad is None for p in module.parameters())


def test_the_peer_is_fairseqs_attention_with_the_same_sizes(rows):
    peers = {id(row.peer.module) for name, row in rows.items() if name != "banded"}
    assert len(peers) == 1  # one fairseq module, the peer of every module row
    peer = rows["local-k"].peer
    module = peer.module
    assert type(module) is MultiheadAttention and module.training
    assert (module.embed_dim, module.num_heads) == (host_overhead.EMBED_DIM, host_overhead.HEADS)
    assert module.self_attention and module.kdim == module.vdim == module.embed_dim
    ours = rows["local-k"].ours.module
    assert (ours.embed_dim, len(ours.head_specs)) == (module.embed_dim, module.num_heads)
    torch.testing.assert_close(peer.forward(), direct_call(module, peer.leaves[0]))


def test_each_module_row_has_its_mechanism(rows):
    def module(name):
        return rows[name].ours.module

    assert {spec.mask for spec in module("local-k").head_specs} == {"local-2"}
    assert module("local-k").all_heads_local
    pande = module("pande").head_specs
    assert {"identity", "prev-1", "next-2", "band-2"} <= {spec.mask for spec in pande}
    assert module("pande").num_qk_groups == 1  # every head ties its Q/K to head 0
    assert module("gaussian").localness is not None
    assert {spec.window for spec in module("mw").head_specs} == {"mw"}
    assert {spec.window for spec in module("aw").head_specs} == {"aw"}
    assert module("gates").head_gates is not None
    pruned = module("pruned")
    assert pruned.kept_heads == list(host_overhead.PRUNED_KEPT_HEADS)
    assert pruned.head_gates is None and pruned.v_proj.out_features == 2 * pruned.head_dim


def test_the_pruned_layer_computes_what_the_gated_layer_computes_at_test_time():
    with host_overhead.ModelBuilder() as builder:
        gated, args, task = builder.build("transformer_local", ("--head-gates", "enc"))
        pruned = host_overhead.pruned_model(gated, args, task, host_overhead.PRUNED_KEPT_HEADS)
    x = torch.randn(host_overhead.LENGTH, host_overhead.BATCH, host_overhead.EMBED_DIM)
    gated_layer = host_overhead.encoder_self_attention(gated.eval())
    pruned_layer = host_overhead.encoder_self_attention(pruned.eval())
    torch.testing.assert_close(direct_call(pruned_layer, x), direct_call(gated_layer, x))


def test_the_script_prints_every_row_with_sane_numbers(tmp_path):
    output = tmp_path / "table.md"
    command = [sys.executable, SCRIPT, "--rounds", "2", "--calls", "3", "--output", str(output)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = output.read_text()
    assert table in proc.stdout
    lines = [line for line in table.splitlines() if line.startswith("| ")][1:]  # header out
    assert len(lines) == len(host_overhead.ROW_KINDS)
    for kind, line in zip(host_overhead.ROW_KINDS, lines):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        what, peer, ours_us, peer_us, ratio, per_round, target, met, ours_ops, peer_ops = cells
        assert (what, peer) == (kind.ours, kind.peer)
        ours_us, peer_us, ratio = float(ours_us), float(peer_us), float(ratio)
        assert 0 < ours_us < 1e6 and 0 < peer_us < 1e6
        assert ratio == pytest.approx(ours_us / peer_us, rel=0.02, abs=0.01)
        assert re.fullmatch(r"\d+\.\d\d-\d+\.\d\d", per_round)
        assert target == f"<= {kind.target:.1f}"
        assert met == ("yes" if ratio <= kind.target else "no")
        assert int(ours_ops) > 0 and int(peer_ops) > 0


def test_rows_can_be_chosen():
    chosen = host_overhead.build_rows(["pande", "banded"], CPU)
    assert [row.kind.name for row in chosen] == ["banded", "pande"]  # in the table's order


@pytest.mark.parametrize("ours, met", [(1.304, True), (1.306, False), (1.2, True), (1.4, False)])
def test_a_row_is_judged_on_the_ratio_the_table_prints(ours, met):
    kind = dataclasses.replace(host_overhead.ROW_KINDS[0], target=1.3)
    result = host_overhead.RowResult(kind, {"ours": [ours], "peer": [1.0]}, {"ours": 1, "peer": 1})
    assert result.met is met
    row = host_overhead.report([result], "", cuda=False).splitlines()[-1]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4] == f"{ours:.2f}" and cells[7] == ("yes" if met else "no")
