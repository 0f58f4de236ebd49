"""AenvConfig validation and secret redaction."""

from __future__ import annotations

import pytest

from areal_env.envs.aenv.config import AenvConfig, AenvConfigError, redact_url


def test_defaults_are_valid():
    cfg = AenvConfig()
    assert cfg.mode == "direct"
    assert cfg.tool_error_policy == "append_error"
    assert cfg.data_plane_url == "http://127.0.0.1:8081"


@pytest.mark.parametrize(
    "field,value",
    [
        ("env_name", ""),
        ("env_name", "calc/1.0"),
        ("env_name", "calc@"),
        ("aenv_url", ""),
        ("aenv_url", "ftp://host"),
        ("aenv_url", "http://"),
        ("mode", "k8s"),
        ("timeout", 0),
        ("timeout", -1.0),
        ("timeout", True),
        ("startup_timeout", "10"),
        ("tool_call_timeout", 0.0),
        ("max_retries", -1),
        ("max_retries", 1.5),
        ("retry_delay", -0.1),
        ("ttl", "forever"),
        ("environment_variables", {"A": 1}),
        ("tool_error_policy", "ignore"),
        ("skip_health_check", "yes"),
        ("auto_release", 1),
        ("max_tool_output_tokens", 0),
        ("labels", {"a": 1}),
        ("arguments", "--x"),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(AenvConfigError, match=rf"aenv\.{field}="):
        AenvConfig(**{field: value})


def test_from_dict_refuses_unknown_keys_and_lists_valid_ones():
    with pytest.raises(
        AenvConfigError, match=r"unknown aenv config key 'tool_timeout'.*tool_call_timeout"
    ):
        AenvConfig.from_dict({"env_name": "x@1", "tool_timeout": 3})
    cfg = AenvConfig.from_dict({"env_name": "x@1", "max_retries": 0})
    assert cfg.max_retries == 0 and AenvConfig.from_dict(cfg) is cfg


def test_new_revalidates():
    with pytest.raises(AenvConfigError, match="max_retries"):
        AenvConfig().new(max_retries=-2)


def test_secrets_never_appear_in_repr_or_errors():
    cfg = AenvConfig(
        aenv_url="http://alice:s3cret@envs.example.com?token=abc123&region=eu",
        api_key="sk-live-xyz",
        environment_variables={"DB_PASSWORD": "hunter2"},
    )
    text = repr(cfg) + str(cfg)
    for secret in ("s3cret", "abc123", "sk-live-xyz", "hunter2", "alice"):
        assert secret not in text
    assert "region=eu" in text and "envs.example.com" in text
    assert cfg.host == "envs.example.com"
    with pytest.raises(AenvConfigError) as err:
        AenvConfig(aenv_url="ftp://bob:pw123@host")
    assert "pw123" not in str(err.value)


@pytest.mark.parametrize(
    "url,expected",
    [
        ("http://127.0.0.1", "http://127.0.0.1"),
        ("http://u:p@h:8080/x?api_key=k&a=1", "http://***@h:8080/x?api_key=***&a=1"),
        ("h.example?sig=zzz", "h.example?sig=***"),
        (None, "None"),
    ],
)
def test_redact_url(url, expected):
    assert redact_url(url) == expected
