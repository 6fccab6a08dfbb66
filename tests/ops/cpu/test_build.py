"""Building and loading the native CPU kernels (pagedllm/ops/cpu/native.py, csrc/):
the cache, the ABI check, and the fallback to torch when a build fails."""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time

from pagedllm.ops.cpu import native

from kernel_checks import require_native

require_native()


def header_constants() -> dict[str, int]:
    """PD_ABI_VERSION and the PD_* return codes as csrc/pd_kernels.h defines them."""
    header = (native.CSRC / "pd_kernels.h").read_text()
    consts = {name: int(value) for name, value in re.findall(r"\b(PD_[A-Z]+) = (-?\d+)", header)}
    consts["PD_ABI_VERSION"] = int(re.search(r"#define PD_ABI_VERSION (\d+)", header).group(1))
    return consts


def test_build_is_cached_under_the_cache_dir(tmp_path, monkeypatch):
    build_kernels = native._load_library.__wrapped__  # the uncached builder behind kernels()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    lib = build_kernels()
    assert lib is not None, "building the kernels into a fresh cache dir failed"
    files = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert len(files) == 1 and files[0].startswith("cpu_kernels-") and files[0].endswith(".so"), \
        f"the cache dir should hold the one built library, no temporaries: {files}"
    assert lib.pd_abi_version() == native.ABI_VERSION
    assert header_constants() == {"PD_ABI_VERSION": native.ABI_VERSION, "PD_OK": native.PD_OK,
                                  "PD_EINVAL": native.PD_EINVAL, "PD_ENOMEM": native.PD_ENOMEM,
                                  "PD_ERANGE": native.PD_ERANGE}, "native.py's constants differ from pd_kernels.h"
    # a second process would load the cached file: no rebuild
    def no_rebuild(*args):
        raise AssertionError("rebuilt although the library was cached")

    monkeypatch.setattr(native, "_build", no_rebuild)
    assert build_kernels() is not None
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == files


def test_build_failures_turn_the_native_path_off(tmp_path, monkeypatch):
    build_kernels = native._load_library.__wrapped__
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # a "compiler" that always fails
    assert build_kernels() is None, "a failed build should leave the torch paths on, not raise"
    assert not any((tmp_path / "native").iterdir()), "a failed build left files behind"
    monkeypatch.delenv("CC")
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", off)
        assert build_kernels() is None, f"PAGEDLLM_CPU_KERNELS={off} should turn the native kernels off"


def test_a_build_in_flight_is_waited_for_not_repeated(tmp_path, monkeypatch):
    """The engine builds the library on a background thread (OpImpl.prepare) while the main
    thread reads the model: a kernel call arriving meanwhile must wait for that build and
    share its library, not start a second compiler run into the same cache."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    builds = []
    real_build = native._build

    def counted(compiler, target):
        builds.append(threading.current_thread().name)
        time.sleep(0.5)  # hold the build open while the other thread asks
        real_build(compiler, target)

    monkeypatch.setattr(native, "_build", counted)
    native.forget_kernels()
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(native.kernels()), name=f"caller-{i}")
                   for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(builds) == 1, f"two callers built the library {len(builds)} times: {builds}"
        assert len(results) == 2 and results[0] is not None and results[0] is results[1]
    finally:
        native.forget_kernels()  # the next test loads the library from the usual cache again


def test_an_engine_builds_the_library_while_it_opens_the_model(tmp_path, monkeypatch, caplog, tiny_model_dir):
    """A first start-up on a machine: the compiler runs on the op set-up thread the engine
    starts before reading the model's config and tokenizer, not after them on the main one."""
    from pagedllm import LLM

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    native.forget_kernels()
    try:
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
        builders = [r.threadName for r in caplog.records if r.getMessage().startswith("building native CPU kernels")]
        assert builders == ["pagedllm-prepare-ops"], f"the library was built on {builders}"
    finally:
        native.forget_kernels()


def test_compile_units_cover_every_source_once_balanced_by_size():
    """The build splits csrc/*.c into one unit per compiler process: every source exactly
    once, the largest source (the start-up's critical path) starting the first unit, each
    further one onto the unit with the fewest bytes so far."""
    sources = native.SOURCES
    largest = max(sources, key=lambda src: src.stat().st_size)
    for workers in (1, 2, 3, 4, len(sources), len(sources) + 5):
        units = native.compile_units(sources, workers)
        flat = [src for unit in units for src in unit]
        assert sorted(flat) == sorted(sources), f"{workers} workers: units {units} miss or repeat a source"
        assert len(units) == min(workers, len(sources)), f"{workers} workers: {len(units)} units"
        assert units[0][0] == largest, f"{workers} workers: the largest source should start the first unit"
        sizes = [sum(src.stat().st_size for src in unit) for unit in units]
        for unit, size in zip(units, sizes):
            if len(unit) > 1:  # a unit's last source went to the then smallest unit
                assert size - unit[-1].stat().st_size <= min(sizes), f"{workers} workers: unbalanced {sizes}"
        if workers >= len(sources):
            assert all(len(unit) == 1 for unit in units), f"{workers} workers: a source shares a unit"
