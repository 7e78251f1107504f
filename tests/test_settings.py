"""The one coercion routine: configuration files and strategy settings check alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import pytest

from fedloom import ConfigError, StrategyConfig
from fedloom.config import AuthConfig, from_mapping
from fedloom.settings import coerce, format_default, type_name


@pytest.mark.parametrize(("hint", "value", "expected"), [
    (float, 3, 3.0),
    (int, 3, 3),
    (bool, True, True),
    (str, "x", "x"),
    (int | None, None, None),
    (float | None, 2, 2.0),
    (Literal["clip", "reject"], "reject", "reject"),
    (tuple[str, ...], ["a", "b"], ("a", "b")),
    (Mapping, {"local_epochs": 2}, {"local_epochs": 2}),
])
def test_accepted_values_come_back_typed(hint, value, expected) -> None:
    got = coerce("s", hint, value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(("hint", "value", "message"), [
    (float, True, "must be a number"),
    (float, "fast", "must be a number"),
    (int, 1.5, "must be an integer"),
    (int, False, "must be an integer"),
    (bool, 1, "true or false"),
    (str, 3, "must be a string"),
    (Literal["clip", "reject"], "median", "must be one of 'clip', 'reject'"),
    (tuple[str, ...], "a", "must be a list"),
    (Mapping, {"k": [1]}, "boolean, number or string"),
])
def test_refused_values_name_the_setting(hint, value, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        coerce("table.key", hint, value)
    assert info.value.setting.startswith("table.key")


def test_nested_tables_and_the_strategy_table() -> None:
    auth = coerce("auth", AuthConfig, {"allow": ["site-1"], "anonymous": False})
    assert auth == AuthConfig(allow=("site-1",))
    strategy = coerce("strategy", StrategyConfig, {"name": "fedyogi", "eta": 0.1})
    assert strategy == StrategyConfig("fedyogi", {"eta": 0.1})
    with pytest.raises(ConfigError, match="must be a table"):
        coerce("auth", AuthConfig, 3)
    with pytest.raises(ConfigError) as info:
        from_mapping(AuthConfig, {"allow": [1]}, where="auth.")
    assert info.value.setting == "auth.allow"


def test_help_formatting() -> None:
    assert type_name(float | None) == "float, optional"
    assert type_name(Literal["clip", "reject"]) == '"clip" | "reject"'
    assert [format_default(v) for v in (None, True, "clip", 0.001)] == [
        "unset", "true", '"clip"', "0.001"]
