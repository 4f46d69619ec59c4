"""``run.compile_cache``: where a run keeps its compiled programs when not told (tests/cli/test_sft_cli.py shows a
rerun loading its step from there)."""

import jax
import numpy as np
import pytest

from gemport.run.compile_cache import ENV, compile_cache, default_dir
from gemport.step.fit import refused


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


HBM = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm."


def test_a_refused_program_is_recalled_not_compiled_again(tmp_path, monkeypatch):
    """XLA:CPU refuses nothing, so the compiler is made to refuse as libtpu does past the HBM: the refusal is kept
    in the cache, and the same program compiled again (after JAX forgets its in-memory caches, as a new process
    would) is refused at once, saying so, without compiling; other errors and other programs compile as before."""
    from jax._src import compiler  # JAX's call into XLA, stood in for by a refusing compiler

    compiles = []

    def refusing(*args, **kwargs):
        compiles.append(1)
        raise jax.errors.JaxRuntimeError(f"{HBM}\nTotal hbm usage >= 17.51G")

    use = compile_cache(tmp_path)
    seven = np.ones(7, np.float32)  # host arrays: jnp's own would compile programs of their own under the patch
    try:
        step = jax.jit(lambda x: x * 3 + 1)
        with monkeypatch.context() as patched:
            patched.setattr(compiler, "backend_compile_and_load", refusing)
            with pytest.raises(jax.errors.JaxRuntimeError) as first:
                step(seven)
            jax.clear_caches()
            with pytest.raises(jax.errors.JaxRuntimeError) as again:
                step(seven)
        assert len(compiles) == 1
        assert refused(first.value) and refused(again.value)
        assert str(again.value).splitlines()[0] == (
            f"{HBM} (recalled: the compile cache kept this program's refusal by an earlier compile)")
        assert str(again.value).splitlines()[1] == "Total hbm usage >= 17.51G"
        assert use.recalled == 1 and use.loaded == 0 and "1 refusal recalled" in str(use), str(use)
        np.testing.assert_array_equal(step(np.ones(8, np.float32)), np.full(8, 4.0))  # another program compiles
        kept, = tmp_path.glob("*-refused*")
        kept.write_bytes(b'{"error": "RESOURCE_EX')  # its writer killed: no record, so the program compiles again
        with monkeypatch.context() as patched:
            patched.setattr(compiler, "backend_compile_and_load", refusing)
            jax.clear_caches()
            with pytest.raises(jax.errors.JaxRuntimeError) as cut:
                step(seven)
        assert len(compiles) == 2 and "recalled" not in str(cut.value) and use.recalled == 1

        def failing(*args, **kwargs):
            compiles.append(1)
            raise jax.errors.JaxRuntimeError("INTERNAL: something else")

        other = jax.jit(lambda x: x - 2)
        with monkeypatch.context() as patched:
            patched.setattr(compiler, "backend_compile_and_load", failing)
            for _ in range(2):
                with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
                    other(seven)
                jax.clear_caches()
        assert len(compiles) == 4  # not a refusal: compiled, and failed, each time
    finally:
        use.close()
    with monkeypatch.context() as patched:  # closed: nothing is recalled any more
        patched.setattr(compiler, "backend_compile_and_load", refusing)
        jax.clear_caches()
        with pytest.raises(jax.errors.JaxRuntimeError):
            step(seven)
    assert len(compiles) == 5
