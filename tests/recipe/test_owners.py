"""The recorded defaults of TRL's and transformers' config dataclasses against the installed owners.

The suite has TRL and transformers installed: each recorded default must be the installed owner's, at the
recorded version (regenerate with ``python -m gemport.recipe`` for a new TRL or transformers). An owner
installed at another version than the recorded one is followed, and what differs is named in a warning.
"""

import json
import warnings

import pytest

from gemport.errors import DefaultsWarning
from gemport.recipe import owners


def test_the_table_is_the_installed_owners_at_their_versions():
    table = owners.recorded()
    assert set(table) == set(owners.OWNERS)
    for owner, entry in table.items():
        assert entry["package"] == owners.OWNERS[owner]
        assert entry["version"] == owners.installed_version(entry["package"]), (
            f"{owner}: recorded from {entry['package']} {entry['version']}, installed "
            f"{owners.installed_version(entry['package'])}: run python -m gemport.recipe")
        installed = owners.class_defaults(owners.owner_class(owner))
        assert owners.differences(owner, installed) == {}, owner


def test_a_regenerated_table_is_the_recorded_one(tmp_path):
    assert owners.main([str(tmp_path / "defaults.json")]) == 0
    assert json.loads((tmp_path / "defaults.json").read_text()) == json.loads(owners.TABLE.read_text())


def test_the_recorded_defaults_are_read_at_the_recorded_version(monkeypatch):
    monkeypatch.setattr(owners, "owner_class", lambda owner: pytest.fail("the owner was imported"))
    owners._defaults.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert owners.defaults("SFTConfig") == owners.recorded()["SFTConfig"]["defaults"]
    finally:
        owners._defaults.cache_clear()


def test_an_owner_installed_at_another_version_is_followed_and_named(monkeypatch):
    """A changed default of an installed TRL (here ``max_length``) is followed, and the warning names it with
    both versions; an absent owner reads the recorded table."""
    recorded = owners.recorded()["SFTConfig"]
    changed = dict(recorded["defaults"], max_length=2048)
    monkeypatch.setattr(owners, "installed_version", lambda package: "99.0" if package == "trl" else None)
    monkeypatch.setattr(owners, "class_defaults", lambda cls: dict(changed))
    owners._defaults.cache_clear()
    try:
        with pytest.warns(DefaultsWarning, match=r"trl 99.0 is installed .* from 1\.16\.0; 1 differ: max_length "
                                                 r"\(1024 -> 2048\)"):
            assert owners.defaults("SFTConfig")["max_length"] == 2048
        monkeypatch.setattr(owners, "installed_version", lambda package: None)
        owners._defaults.cache_clear()
        assert owners.defaults("SFTConfig")["max_length"] == recorded["defaults"]["max_length"]
    finally:
        owners._defaults.cache_clear()
