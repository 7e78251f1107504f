"""Per-client tokens: stored only as hashes, compared in constant time, revocable."""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from pathlib import Path

import pytest

from fedloom import tokens as tokens_module
from fedloom.cli import main
from fedloom.errors import ConfigError
from fedloom.tokens import TokenStore, hash_token, token_name


def test_add_stores_only_a_hash(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "tokens.toml")
    token = store.add("site-1")
    text = store.path.read_text()
    secret = token.rpartition(".")[2]
    assert token.startswith("site-1.") and len(secret) >= 43  # 32 random bytes
    assert secret not in text and token not in text
    entry = tomllib.loads(text)["tokens"]["site-1"]
    # The stored form is SHA-256 over a domain tag and the token (derived independently).
    expected = hashlib.sha256(b"fedloom-token-v1\0" + token.encode()).hexdigest()
    assert entry == "sha256:" + expected
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_verify(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "tokens.toml")
    one, two = store.add("site-1"), store.add("site-2")
    assert store.verify(one) == "site-1" and store.verify(two) == "site-2"
    name, _, secret = one.rpartition(".")
    forged = f"{name}.{secret[:-1]}{'A' if secret[-1] != 'A' else 'B'}"
    for bad in (forged, f"site-2.{secret}", f"nobody.{secret}", "", "no-dot", "x" * 5000):
        assert store.verify(bad) is None, bad


def test_comparison_is_constant_time(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = []
    real = tokens_module.hmac.compare_digest

    def spy(a, b):  # type: ignore[no-untyped-def]
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens_module.hmac, "compare_digest", spy)
    store = TokenStore(tmp_path / "tokens.toml")
    token = store.add("site-1")
    assert store.verify(token) == "site-1"
    assert store.verify("unknown.abc") is None  # compared too (timing says nothing)
    assert len(calls) == 2


def test_names_with_dots_and_the_name_of_a_token() -> None:
    assert token_name("hospital.example.org.s3cr3t") == "hospital.example.org"
    assert token_name("nodot") == "" and token_name(".x") == "" and token_name("x.") == ""
    assert hash_token("a") != hash_token("b")


def test_add_twice_needs_replace_and_the_old_token_dies(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "tokens.toml")
    old = store.add("site-1")
    with pytest.raises(ConfigError, match="replace"):
        store.add("site-1")
    new = store.add("site-1", replace=True)
    assert store.verify(new) == "site-1" and store.verify(old) is None


def test_a_changed_file_is_reread(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    admin = TokenStore(path)
    token = admin.add("site-1")
    server = TokenStore.load(path)
    assert server.verify(token) == "site-1"
    # another process revokes it: the file is replaced (a new inode, another size), so
    # the change shows at once, even where mtimes are coarse
    TokenStore(path).remove("site-1")
    server.refresh()
    assert server.verify(token) is None


def test_load_refuses_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fedloom tokens add"):
        TokenStore.load(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text('[tokens]\n"site-1" = "plaintext-token"\n')
    with pytest.raises(ConfigError, match="not a sha256"):
        TokenStore.load(bad)


def test_cli_prints_the_token_once(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.toml"
    assert main(["tokens", "add", "site-7", "--file", str(path)]) == 0
    out, err = capsys.readouterr()
    token = out.strip()
    assert token.startswith("site-7.") and "shown only now" in err
    assert token not in path.read_text()
    assert TokenStore.load(path).verify(token) == "site-7"
    assert main(["tokens", "list", "--file", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["site-7"]
    assert main(["tokens", "remove", "site-7", "--file", str(path)]) == 0
    assert TokenStore.load(path).verify(token) is None
    assert main(["tokens", "remove", "site-7", "--file", str(path)]) == 2
    assert main(["tokens", "add", "bad name", "--file", str(path)]) == 2
    assert os.stat(path).st_mode & 0o077 == 0
