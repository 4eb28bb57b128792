"""torch.compile's cache goes to a folder that outlives /tmp, unless the user named one."""

from __future__ import annotations

import os

import pytest

from bridge_cli.runtime.compile_cache import VARIABLE, use_persistent_compile_cache


@pytest.fixture
def environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return monkeypatch


def test_torchs_default_moves_to_the_user_cache(environment, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    environment.setenv(VARIABLE, default_cache_dir())  # what torch writes there on its first look
    assert use_persistent_compile_cache() == str(tmp_path / "cache" / "bridge" / "torchinductor")
    assert os.environ[VARIABLE] == str(tmp_path / "cache" / "bridge" / "torchinductor")
    assert (tmp_path / "cache" / "bridge" / "torchinductor").is_dir()


def test_unset_moves_there_too(environment, tmp_path):
    environment.delenv(VARIABLE, raising=False)
    assert use_persistent_compile_cache() == str(tmp_path / "cache" / "bridge" / "torchinductor")


def test_a_folder_the_user_named_stays(environment, tmp_path):
    environment.setenv(VARIABLE, str(tmp_path / "mine"))
    assert use_persistent_compile_cache() == str(tmp_path / "mine")
    assert os.environ[VARIABLE] == str(tmp_path / "mine")
    assert not (tmp_path / "cache").exists()


def test_a_cache_home_that_cannot_be_written_leaves_torchs_default(environment, tmp_path):
    environment.delenv(VARIABLE, raising=False)
    (tmp_path / "cache").write_text("a file where the folder would go")
    assert use_persistent_compile_cache() is None
    assert VARIABLE not in os.environ
