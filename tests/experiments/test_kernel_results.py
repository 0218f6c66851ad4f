"""The docs' kernel tables: made from the committed GPU records, and refusing what is not one."""

import json
import os

import pytest

from local_attn_fairseq.experiments import kernel_results

from ..conftest import run_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "results_table.py")
RESULTS = os.path.join(REPO, "benchmarks", "results")
GRID = os.path.join(RESULTS, "h200_bf16_d64_fwd_bwd_grid.json")
HEAD_DIMS = os.path.join(RESULTS, "h200_bf16_d32_d128_fwd_bwd.json")


def results_table(*args, cwd):
    """benchmarks/results_table.py in this process (a table needs no Python start)."""
    return run_script(os.path.relpath(SCRIPT, REPO), *args, cwd=cwd)


def table_rows(text):
    """{column: cell} per row of the Markdown table in `text`."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, rows = split[0], split[2:]  # the second line is the separator
    return [dict(zip(header, row)) for row in rows]


def record(route, T=1024, w=33, ms=1.0, note=None, D=64, gpu="GPU A", **figures):
    base = dict(gpu=gpu, torch="2.9.0", date="2026-01-02T03:04:05+00:00", dtype="float16")
    base.update(B=2, H=4, D=D, T=T, w=w, mode="fwd+bwd", route=route, peak_mib=1.0)
    measured = dict(ms=ms, band_tflops=figures.get("tflops", 1.0), hbm_gbps=figures.get("gbps"))
    if note is not None:
        measured = dict(ms=None, band_tflops=None, hbm_gbps=None)
    return {**base, **measured, "note": note}


def test_the_script_tabulates_the_committed_records(tmp_path):
    output = tmp_path / "kernels.md"
    proc = results_table(GRID, HEAD_DIMS, "--output", output, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == output.read_text()
    assert proc.stdout.splitlines()[0] == "GPU: NVIDIA H200; torch 2.11.0+cu130; 2026-11-26"

    rows = table_rows(proc.stdout)
    assert len(rows) == 25 + 2  # the grid's 5 lengths x 5 widths, and D=32, D=128 at T=4096
    assert [row["B x H x D"] for row in rows[:2]] == ["8 x 8 x 32", "8 x 8 x 64"]
    # T=16384, w=33 read by hand from the grid's records: tensor-core 2.5168 ms, flex 3.2997,
    # global 31.348, CUDA-core 11.333, blocked 6.9178, sdpa skipped (T x T memory)
    row = next(r for r in rows if (r["B x H x D"], r["T"], r["w"]) == ("8 x 8 x 64", "16384", "33"))
    assert (row["tensor-core ms"], row["flex ms"], row["global ms"]) == ("2.52", "3.30", "31.35")
    assert (row["banded ms"], row["blocked ms"], row["sdpa ms"]) == ("11.33", "6.92", "-")
    assert (row["tensor-core TFLOP/s"], row["tensor-core GB/s"]) == ("10.6", "643")
    assert (row["flex / tensor-core"], row["global / tensor-core"]) == ("1.31", "12.46")

    # every time in the table is its record's, to the digits shown
    with open(GRID) as handle:
        by_cell = {(r["D"], r["T"], r["w"], r["route"]): r for r in json.load(handle)}
    for row in rows:
        if row["B x H x D"] != "8 x 8 x 64":
            continue
        for route in kernel_results.ROUTES:
            measured = by_cell[64, int(row["T"]), int(row["w"]), route]
            shown = row[f"{route} ms"]
            assert (shown == "-") == (measured["note"] is not None)
            if shown != "-":
                assert float(shown) == pytest.approx(measured["ms"], abs=0.006)


def test_the_table_of_synthetic_records():
    records = [
        record("tensor-core", ms=2.0, tflops=12.345, gbps=600.4),
        record("banded", ms=8.0),
        record("flex", ms=3.0),
        record("global", ms=0.5),
        record("sdpa", note="skipped (T x T memory)"),
        record("naive", ms=9.0),  # not a column of the docs' tables
        # a second cell, in the records before the first: rows come sorted by cell
        record("tensor-core", T=256, note="no kernel for this dtype"),
        record("banded", T=256, ms=0.25),
        record("flex", T=256, ms=0.1234),
    ]
    expected = (
        "GPU: GPU A; torch 2.9.0; 2026-01-02\n"
        "\n"
        "| dtype | B x H x D | mode | T | w | banded ms | tensor-core ms | flex ms | sdpa ms "
        "| global ms | tensor-core TFLOP/s | tensor-core GB/s | flex / tensor-core "
        "| global / tensor-core |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| float16 | 2 x 4 x 64 | fwd+bwd | 256 | 33 | 0.250 | - | 0.123 | - | - | - | - | - "
        "| - |\n"
        "| float16 | 2 x 4 x 64 | fwd+bwd | 1024 | 33 | 8.00 | 2.00 | 3.00 | - | 0.500 | 12.3 "
        "| 600 | 1.50 | 0.25 |\n"
    )
    assert kernel_results.kernel_table(kernel_results.check_records(records, "x")) == expected


def test_a_table_without_the_tensor_core_kernel_has_no_column_of_it():
    records = [record("banded", gpu="GPU B"), record("flex", gpu="GPU A", ms=0.5)]
    text = kernel_results.kernel_table(records)
    assert text.splitlines()[0] == "GPU: GPU A, GPU B; torch 2.9.0; 2026-01-02"
    assert [list(row.values()) for row in table_rows(text)] == [
        # two GPUs: each row names its own
        ["GPU A", "float16", "2 x 4 x 64", "fwd+bwd", "1024", "33", "-", "0.500"],
        ["GPU B", "float16", "2 x 4 x 64", "fwd+bwd", "1024", "33", "1.00", "-"],
    ]


def test_the_script_refuses_a_malformed_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([record("banded"), {"gpu": "NVIDIA H200", "route": "flex"}]))
    proc = results_table(GRID, broken, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert f"{broken}: record 1 lacks 'torch', 'date', 'dtype', 'B'" in proc.stderr


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, fault",
    [
        ("T,w,ms\n1024,33,2.5\n", "not JSON"),
        (json.dumps({"records": [record("banded")]}), "not a list of benchmark records"),
        ("[]", "holds no records"),
        (json.dumps([record("banded"), 7]), "record 1 is a JSON int, not an object"),
        (json.dumps([record("banded", T="1024")]), "record 0: 'T' must be an integer"),
        (json.dumps([record("banded", ms="2.5")]), "record 0: 'ms' must be a number or null"),
        (json.dumps([record("banded", ms=None)]), "record 0: 'ms' is null but no 'note'"),
    ],
)
def test_what_is_not_a_list_of_records_is_refused_naming_the_file(tmp_path, text, fault):
    path = write(tmp_path, "records.json", text)
    with pytest.raises(kernel_results.MalformedRecords) as refusal:
        kernel_results.load_files([path])
    assert str(refusal.value).startswith(f"{path}: ") and fault in str(refusal.value)


def test_a_route_measured_twice_for_one_cell_is_refused(tmp_path):
    first = write(tmp_path, "first.json", json.dumps([record("banded")]))
    again = write(tmp_path, "again.json", json.dumps([record("flex"), record("banded", ms=2)]))
    with pytest.raises(kernel_results.MalformedRecords, match="already measured") as refusal:
        kernel_results.load_files([first, again])
    assert str(refusal.value).startswith(f"{again}: record 1 ") and f"{first}: record 0" in str(
        refusal.value
    )
