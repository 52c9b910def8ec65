"""`ApiKeys`: loading keys from text, the environment or a file; read and admin scopes; and
every way a request's key can be refused (missing, not a bearer, unknown, too weak)."""

from __future__ import annotations

import pytest

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import (
    InvalidRequestError,
    PermissionDeniedError,
    UnauthenticatedError,
)

READ_SECRET = "r" * 16
ADMIN_SECRET = "a:b" + "x" * 13  # a colon inside a secret is part of it
KEYS_TEXT = f"""
# operators
ops:admin:{ADMIN_SECRET}
  dash : read : {READ_SECRET}   # the dashboard's key
"""


@pytest.fixture
def keys() -> ApiKeys:
    return ApiKeys.parse(KEYS_TEXT)


def test_parse_reads_items_with_comments_blank_lines_and_spaces(keys):
    assert keys.enabled
    assert [(k.name, k.scope, k.secret) for k in keys.keys] == [
        ("ops", "admin", ADMIN_SECRET),
        ("dash", "read", READ_SECRET),
    ]
    by_commas = ApiKeys.parse(f"ops:admin:{ADMIN_SECRET}, dash:read:{READ_SECRET}")
    assert by_commas.keys == keys.keys


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ops:admin", "name:scope:secret"),
        (f"ops:{READ_SECRET}", "name:scope:secret"),
        (f"ops:owner:{ADMIN_SECRET}", "scope must be read or admin"),
        ("ops:admin:" + "s" * 15, "shorter than 16"),
    ],
)
def test_a_malformed_or_weak_key_is_refused_at_load(text, match):
    with pytest.raises(InvalidRequestError, match=match):
        ApiKeys.parse(text)


def test_no_keys_means_auth_is_off():
    for off in (ApiKeys(), ApiKeys.parse(""), ApiKeys.parse("# nothing yet\n\n")):
        assert not off.enabled
        assert off.check(None, "admin") is None
        assert off.check("Bearer anything", "admin") is None


def test_from_env_reads_the_variable_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("COXSWAIN_API_KEYS_FILE", raising=False)
    monkeypatch.setenv("COXSWAIN_API_KEYS", f"dash:read:{READ_SECRET}")
    assert [k.name for k in ApiKeys.from_env().keys] == ["dash"]
    key_file = tmp_path / "keys"
    key_file.write_text(KEYS_TEXT)
    assert [k.name for k in ApiKeys.from_env(key_file).keys] == ["ops", "dash"]
    monkeypatch.setenv("COXSWAIN_API_KEYS_FILE", str(key_file))  # the file wins over the var
    assert [k.name for k in ApiKeys.from_env().keys] == ["ops", "dash"]
    monkeypatch.delenv("COXSWAIN_API_KEYS_FILE")
    monkeypatch.delenv("COXSWAIN_API_KEYS")
    assert not ApiKeys.from_env().enabled


def test_a_read_key_reads_and_only_an_admin_key_administers(keys):
    assert keys.check(f"Bearer {READ_SECRET}").name == "dash"
    assert keys.check(f"Bearer {READ_SECRET}", "read").name == "dash"
    with pytest.raises(PermissionDeniedError, match="'dash' is read-only"):
        keys.check(f"Bearer {READ_SECRET}", "admin")
    assert keys.check(f"Bearer {ADMIN_SECRET}", "admin").name == "ops"
    assert keys.check(f"Bearer {ADMIN_SECRET}", "read").name == "ops"


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer   ", READ_SECRET, f"Basic {READ_SECRET}", f"Token {READ_SECRET}"],
)
def test_a_missing_or_non_bearer_header_is_unauthenticated(keys, authorization):
    with pytest.raises(UnauthenticatedError, match="missing bearer API key"):
        keys.check(authorization)


@pytest.mark.parametrize(
    "secret", ["w" * 16, READ_SECRET[:-1], READ_SECRET + "r", READ_SECRET.upper(), "ops"]
)
def test_a_wrong_key_is_unauthenticated(keys, secret):
    with pytest.raises(UnauthenticatedError, match="unknown API key"):
        keys.check(f"Bearer {secret}")


def test_the_bearer_scheme_is_case_insensitive_and_spaces_around_are_ignored(keys):
    assert keys.check(f"bearer {READ_SECRET}").name == "dash"
    assert keys.check(f"  BEARER   {READ_SECRET}  ").name == "dash"


def test_two_keys_are_valid_at_once_while_one_is_rotated():
    old, new = "o" * 16, "n" * 16
    rotating = ApiKeys([ApiKey("old", "read", old), ApiKey("new", "read", new)])
    assert rotating.check(f"Bearer {old}").name == "old"
    assert rotating.check(f"Bearer {new}").name == "new"
    retired = ApiKeys([ApiKey("new", "read", new)])
    with pytest.raises(UnauthenticatedError):
        retired.check(f"Bearer {old}")


def test_a_key_never_shows_its_secret(keys):
    for key in keys.keys:
        assert key.secret not in repr(key) and key.secret not in str(key)
    assert READ_SECRET not in repr(keys.keys)
