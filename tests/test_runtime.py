"""dspo.runtime: process-level thread and allocator settings."""

from __future__ import annotations

import sys

import pytest

from dspo.runtime import configure_allocator


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("DSPO_MALLOC", "DSPO_MALLOC_KEEP_BYTES", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_blocks_stay_on_the_heap_and_child_processes_inherit_it(clean_env):
    import os

    assert configure_allocator() is True
    assert os.environ["MALLOC_MMAP_MAX_"] == "0" and int(os.environ["MALLOC_TRIM_THRESHOLD_"]) == 2**31 - 1
    clean_env.setenv("DSPO_MALLOC_KEEP_BYTES", str(2**30))
    clean_env.delenv("MALLOC_TRIM_THRESHOLD_")
    assert configure_allocator() is True and os.environ["MALLOC_TRIM_THRESHOLD_"] == str(2**30)


def test_system_mode_leaves_glibc_alone_and_bad_values_are_named(clean_env):
    import os

    clean_env.setenv("DSPO_MALLOC", "system")
    assert configure_allocator() is False and "MALLOC_MMAP_MAX_" not in os.environ
    clean_env.setenv("DSPO_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="DSPO_MALLOC='jemalloc'"):
        configure_allocator()
    clean_env.setenv("DSPO_MALLOC", "keep")
    clean_env.setenv("DSPO_MALLOC_KEEP_BYTES", "0")
    with pytest.raises(ValueError, match="DSPO_MALLOC_KEEP_BYTES=0"):
        configure_allocator()
