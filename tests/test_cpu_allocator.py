"""Which malloc a process has, and the environment that starts a program again under tcmalloc
(the start itself: the long-context benchmark's quick run, tests/experiments)."""

import pytest

from local_attn_fairseq import cpu_allocator


@pytest.mark.parametrize(
    "library, expected",
    [
        ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
        ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
        ("/usr/lib/x86_64-linux-gnu/libm.so.6", "glibc"),
    ],
)
def test_the_malloc_is_read_from_the_mapped_libraries(tmp_path, library, expected):
    maps = tmp_path / "maps"
    maps.write_text(
        "55d0c0a00000-55d0c0a21000 r--p 00000000 08:01 1 /usr/bin/python3.11\n"
        "7f1c2c000000-7f1c2c021000 rw-p 00000000 00:00 0 \n"
        f"7f1c3a000000-7f1c3a020000 r-xp 00000000 08:01 2 {library}\n"
        "7ffd4b1f0000-7ffd4b211000 rw-p 00000000 00:00 0 [stack]\n"
    )
    assert cpu_allocator.loaded_allocator(str(maps)) == expected


def test_unreadable_maps_mean_the_system_malloc(tmp_path):
    assert cpu_allocator.loaded_allocator(str(tmp_path / "missing")) == "glibc"


def test_this_process_is_read_as_it_is():
    with open("/proc/self/maps", encoding="utf-8") as maps:
        preloaded = "libtcmalloc" in maps.read()
    assert (cpu_allocator.loaded_allocator() == "tcmalloc") == preloaded


def test_the_library_goes_first_in_ld_preload_and_what_was_there_stays():
    env = cpu_allocator.preload_environment({"LD_PRELOAD": "libmine.so", "A": "1"}, "libt.so.4")
    assert env["LD_PRELOAD"] == "libt.so.4 libmine.so" and env["A"] == "1"
    assert env[cpu_allocator.RESTARTED_VARIABLE] == "libt.so.4"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    alone = cpu_allocator.preload_environment({}, "libt.so.4")
    assert alone["LD_PRELOAD"] == "libt.so.4"


def test_a_program_run_inside_another_is_not_started_again(monkeypatch):
    """Here the program is pytest: starting it again would start the test run again."""
    monkeypatch.setattr(cpu_allocator, "loaded_allocator", lambda: "glibc")
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.delenv(cpu_allocator.RESTARTED_VARIABLE, raising=False)
    monkeypatch.setattr("sys.argv", ["benchmarks/long_context.py", "--quick"])
    assert "does not run as its own process" in cpu_allocator.restart_under_tcmalloc()


def test_why_it_cannot_start_again_is_said(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "loaded_allocator", lambda: "glibc")
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: None)
    assert "apt-get install libtcmalloc-minimal4" in cpu_allocator.restart_under_tcmalloc()
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setenv(cpu_allocator.RESTARTED_VARIABLE, "libtcmalloc_minimal.so.4")
    assert "did not load" in cpu_allocator.restart_under_tcmalloc()
    monkeypatch.setattr(cpu_allocator, "loaded_allocator", lambda: "tcmalloc")
    assert cpu_allocator.restart_under_tcmalloc() == ""
