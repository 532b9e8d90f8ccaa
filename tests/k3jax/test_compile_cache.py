"""The persistent compilation cache switch of the command-line entry points."""

import jax
import pytest

from k3jax.compile_cache import ENV, default_path, enable_compilation_cache


def test_path_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    assert default_path() == str(tmp_path)
    monkeypatch.setenv(ENV, "")
    assert default_path() is None and enable_compilation_cache() is None
    monkeypatch.delenv(ENV)
    assert default_path().endswith("k3jax/jax_cache")


def test_enable_sets_jax_config(tmp_path):
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        assert enable_compilation_cache(str(tmp_path), min_compile_seconds=2.5) == str(tmp_path)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
        with pytest.raises(ValueError, match="min_compile_seconds"):
            enable_compilation_cache(str(tmp_path), min_compile_seconds=-1)
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
