"""Building and loading the native CPU kernels (pagedllm/ops/cpu/native.py, csrc/):
the cache, the ABI check, and the fallback to torch when a build fails."""

from __future__ import annotations

import re
import shutil

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
    build_kernels = native.kernels.__wrapped__  # the uncached builder behind kernels()
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
    build_kernels = native.kernels.__wrapped__
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # a "compiler" that always fails
    assert build_kernels() is None, "a failed build should leave the torch paths on, not raise"
    assert not any((tmp_path / "native").iterdir()), "a failed build left files behind"
    monkeypatch.delenv("CC")
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", off)
        assert build_kernels() is None, f"PAGEDLLM_CPU_KERNELS={off} should turn the native kernels off"
