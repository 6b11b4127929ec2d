"""``SyncOptions`` checks every field when it is built: each bad value is a ``ConfigError`` naming the field and what
it takes (a typo fails at the door, not at the first sync)."""

from __future__ import annotations

import pytest

from rlsync import ConfigError, SyncOptions


@pytest.mark.parametrize(("field", "value", "says"), [
    ("transport", "bogus", "transport='bogus' is not a registered transport"),
    ("transport", "shmm", "did you mean 'shm'"),
    ("transport", 42, "transport=42: a transport's name"),
    ("timeout", "10", "timeout='10': a number of seconds"),
    ("timeout", 0, "timeout=0: a number of seconds above 0"),
    ("timeout", True, "timeout=True"),
    ("verify", "yes", "verify='yes': True or False"),
    ("canary", 1, "canary=1: True or False"),
    ("port", 70000, "port=70000: an integer port"),
    ("port", "80", "port='80'"),
    ("host", "", "host='': the address a reader listens on"),
    ("secret", "", "secret='': a non-empty string"),
    ("wire", "fp16", "wire='fp16': use one of"),
    ("transport_options", ["device"], "transport_options=['device']: a mapping"),
])
def test_a_bad_field_is_refused_when_the_options_are_built(field: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        SyncOptions(**{field: value})


def test_good_options_and_typed_strings_from_a_config_are_accepted() -> None:
    from rlsync.testing import MemoryTransport

    assert SyncOptions(transport="tcp", timeout=10, verify=True, port=5000).timeout == 10
    assert SyncOptions(transport=MemoryTransport).transport is MemoryTransport
    typed = SyncOptions.from_mapping({"timeout": "10", "verify": "true", "port": "5000"})  # what a user types in YAML
    assert (typed.timeout, typed.verify, typed.port) == (10.0, True, 5000)
