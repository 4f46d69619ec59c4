"""``run.compile_cache``: where a run keeps its compiled programs when not told (tests/cli/test_sft_cli.py shows a
rerun loading its step from there)."""

import jax

from gemport.run.compile_cache import ENV, default_dir


def test_the_default_directory_is_gemports_unless_the_environment_or_jax_names_one(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert default_dir() == str(tmp_path / "cache" / "gemport" / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        assert default_dir() == str(tmp_path / "jax")
        monkeypatch.setenv(ENV, str(tmp_path / "mine"))
        assert default_dir() == str(tmp_path / "mine")
        monkeypatch.setenv(ENV, "off")
        assert default_dir() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", kept)
