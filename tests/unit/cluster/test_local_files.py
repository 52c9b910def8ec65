"""The local cluster's files (issue 12, items 7 and 20): secrets are 0600 from the first
byte, the cluster directory is 0700, keys survive until asked to change, and a bad model
directory is refused with a message naming the path and what is missing."""

from __future__ import annotations

import os
import re
import stat

import pytest

from services.cluster.directory import private_dir, write_private
from services.cluster.local import UpOptions, _api_keys
from services.cluster.processes import redacted
from services.common.errors import CheckpointError, InvalidRequestError
from services.common.paths import check_model_dir


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secret_files_are_0600_whatever_the_umask_or_the_old_file(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "state.json"
        path.write_text("old")
        path.chmod(0o644)  # as `up` used to leave it
        write_private(path, "new")
        assert (path.read_text(), mode(path)) == ("new", 0o600)
        fresh = tmp_path / "api_keys"
        write_private(fresh, "k")
        assert mode(fresh) == 0o600
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api_keys", "state.json"]  # no temp


def test_the_cluster_directory_is_the_users_alone(tmp_path):
    d = tmp_path / "cluster"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    assert mode(private_dir(d)) == 0o700
    assert mode(private_dir(tmp_path / "new" / "cluster")) == 0o700


def test_keys_are_kept_until_new_keys(tmp_path):
    first = _api_keys(UpOptions(), tmp_path)
    assert set(first.printed) == {"admin", "read"} and mode(tmp_path / "api_keys") == 0o600
    assert first.text == (tmp_path / "api_keys").read_text()
    assert _api_keys(UpOptions(), tmp_path) == first
    renewed = _api_keys(UpOptions(new_keys=True), tmp_path).printed
    assert renewed["admin"] != first.printed["admin"] and renewed["read"] != first.printed["read"]
    assert _api_keys(UpOptions(), tmp_path).printed == renewed


def test_an_unusable_keys_file_is_named_not_replaced(tmp_path):
    (tmp_path / "api_keys").write_text("admin:admin:short\n")
    with pytest.raises(InvalidRequestError, match=r"api_keys.*--new-keys"):
        _api_keys(UpOptions(), tmp_path)
    assert (tmp_path / "api_keys").read_text() == "admin:admin:short\n"


def test_a_given_keys_file_is_used_as_is_and_checked_at_once(tmp_path):
    given = tmp_path / "mine"
    given.write_text("me:admin:" + "m" * 20 + "\n")
    keys = _api_keys(UpOptions(api_keys_file=str(given)), tmp_path / "cluster")
    assert (keys.file, keys.text, keys.printed) == (str(given), given.read_text(), {})
    assert not (tmp_path / "cluster" / "api_keys").exists()
    with pytest.raises(InvalidRequestError, match=r"--api-keys-file .*missing: No such file"):
        _api_keys(UpOptions(api_keys_file=str(tmp_path / "missing")), tmp_path)
    given.write_text("me:admin:short\n")
    with pytest.raises(InvalidRequestError, match=r"--api-keys-file .*shorter than 16"):
        _api_keys(UpOptions(api_keys_file=str(given)), tmp_path)


def test_the_apps_keys_need_no_file_once_up_has_read_them(tmp_path):
    """What `up` passes the Serve application: a replica that starts after the keys file
    is gone (Serve restarting it) still checks the same keys."""
    from services.gateway.serve_app import AppArgs

    keys = _api_keys(UpOptions(), tmp_path)
    args = AppArgs.model_validate({"api_keys": keys.text, "allow_no_auth": False})
    (tmp_path / "api_keys").unlink()
    restarted = AppArgs.model_validate(args.model_dump()).keys()
    assert restarted.check(f"Bearer {keys.printed['admin']}", "admin").name == "admin"
    assert keys.printed["admin"] not in repr(args)  # the secrets stay out of logs


def test_the_printed_redis_url_hides_the_password():
    assert redacted("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_bad_model_directory_names_the_path_and_what_is_missing(tmp_path, tiny_checkpoint):
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'nope'} does not exist")):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        check_model_dir(tmp_path / "cfg")
    good = tiny_checkpoint("llama")
    check_model_dir(good)
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in good.iterdir():
        if f.name != "tokenizer.json":
            (no_tok / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        check_model_dir(no_tok)
