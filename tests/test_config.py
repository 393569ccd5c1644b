import re
from pathlib import Path

import pytest

from capture_proxy.config import ConfigError, Settings, load_settings

REPO = Path(__file__).resolve().parents[1]


def test_shipped_example_config_is_valid(monkeypatch):
    monkeypatch.delenv("CAPTURE_PROXY_PORT", raising=False)
    settings = load_settings({}, REPO / "configs" / "capture-proxy.toml")
    assert settings.backend_base == "http://127.0.0.1:8000"
    assert settings.max_request_body_bytes == 64 * 1024 * 1024
    assert settings.store_synchronous == "full"


def test_the_example_config_lists_every_setting():
    text = (REPO / "configs" / "capture-proxy.toml").read_text()
    listed = set(re.findall(r"^(?:# ?)?\[?([a-z_]+)\]?(?: =|$)", text, flags=re.M))
    missing = sorted(set(Settings.model_fields) - listed)
    assert missing == [], f"configs/capture-proxy.toml does not list {missing}"


def test_demo_help_names_the_store_it_uses(capsys):
    from capture_proxy.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default ./capture-store" in help_text and "temp" not in help_text


def test_priority_cli_then_env_then_file(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('backend = "http://file:1"\nport = 1111\nhost = "0.0.0.0"\n')
    monkeypatch.setenv("CAPTURE_PROXY_PORT", "2222")
    monkeypatch.setenv("CAPTURE_PROXY_HOST", "10.0.0.1")
    s = load_settings({"host": "127.0.0.2", "port": None}, cfg)
    assert (s.backend_base, s.port, s.host) == ("http://file:1", 2222, "127.0.0.2")


def test_settings_are_frozen():
    s = load_settings({"backend": "http://e:1"})
    with pytest.raises(ValueError):
        s.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "text", "fragment"),
    [
        ({}, None, "backend: Field required"),
        ({"backend": "not a url"}, None, "backend"),
        (
            {"backend": "localhost:8000"},
            None,
            "backend: 'localhost:8000' has no scheme: write http://localhost:8000 (or https://)",
        ),
        (
            {"backend": "http://e:1", "extra_backends": ["127.0.0.1:2"]},
            None,
            "extra_backends: '127.0.0.1:2' has no scheme: write http://127.0.0.1:2",
        ),
        ({"backend": "http://e:1", "port": 70000}, None, "port"),
        ({"backend": "http://e:1", "store_synchronous": "off"}, None, "store_synchronous"),
        ({"backend": "http://e:1", "system_start_date": "1 Jan 2026"}, None, "system_start_date"),
        ({}, 'backend = "http://e:1"\nbogus = 1\n', "unknown setting(s) bogus"),
        ({}, "backend = ", "invalid TOML"),
    ],
)
def test_errors_name_the_setting(tmp_path, values, text, fragment):
    cfg = None
    if text is not None:
        cfg = tmp_path / "c.toml"
        cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(values, cfg)
    assert fragment in str(info.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.toml"):
        load_settings({}, tmp_path / "nope.toml")


def test_the_backends_label_names_every_engine_or_counts_the_many():
    def label(*extra: str) -> str:
        return Settings(
            backend="http://user:pw@127.0.0.1:8001/", extra_backends=list(extra), store="s"
        ).backends_label

    assert label() == "http://user:***@127.0.0.1:8001"
    assert label("http://127.0.0.1:8002/", "http://127.0.0.1:8003") == (
        "http://user:***@127.0.0.1:8001 + http://127.0.0.1:8002 + http://127.0.0.1:8003"
    )
    many = [f"http://127.0.0.1:{8002 + i}" for i in range(4)]
    assert label(*many) == "http://user:***@127.0.0.1:8001 + 4 more engines"


@pytest.mark.parametrize("name", ["captures_token", "proxy_token", "backend_api_key"])
@pytest.mark.parametrize("token", ["", "  "])
def test_an_empty_token_is_refused_not_taken_as_a_token(monkeypatch, name, token):
    """CAPTURE_PROXY_CAPTURES_TOKEN="" started the proxy (even on 0.0.0.0) with a token no
    request could match: every /captures read was a 401."""
    monkeypatch.setenv(f"CAPTURE_PROXY_{name.upper()}", token)
    with pytest.raises(ConfigError) as info:
        load_settings({"backend": "http://e:1", "host": "0.0.0.0"})
    assert str(info.value) == (
        f"invalid settings: {name}: the token is empty: set one, or leave it unset"
    )
    monkeypatch.delenv(f"CAPTURE_PROXY_{name.upper()}")
    with pytest.raises(ConfigError, match=f"{name}: the token is empty"):
        load_settings({"backend": "http://e:1", name: token})


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_a_read_send_timeout_of_zero_or_less_is_refused_naming_it(tmp_path, monkeypatch, value):
    from capture_proxy.cli.errors import ServeExit
    from capture_proxy.cli.parser import build_parser
    from capture_proxy.cli.serve import settings_from_args

    refusal = "invalid settings: read_send_timeout_s: Input should be greater than 0"
    base = ["serve", "--backend", "http://127.0.0.1:9", "--store", str(tmp_path / "s")]
    with pytest.raises(ServeExit) as from_flag:
        settings_from_args(build_parser().parse_args([*base, "--read-send-timeout", value]))
    assert str(from_flag.value) == refusal
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'backend = "http://e:1"\nread_send_timeout_s = {value}\n')
    with pytest.raises(ConfigError) as from_file:
        load_settings({}, cfg)
    assert str(from_file.value) == refusal
    monkeypatch.setenv("CAPTURE_PROXY_READ_SEND_TIMEOUT_S", value)
    with pytest.raises(ConfigError) as from_environment:
        load_settings({"backend": "http://e:1"})
    assert str(from_environment.value) == refusal


def test_the_read_send_timeout_is_a_minute_unless_set(monkeypatch):
    monkeypatch.delenv("CAPTURE_PROXY_READ_SEND_TIMEOUT_S", raising=False)
    assert load_settings({"backend": "http://e:1"}).read_send_timeout_s == 60.0
    monkeypatch.setenv("CAPTURE_PROXY_READ_SEND_TIMEOUT_S", "2.5")
    assert load_settings({"backend": "http://e:1"}).read_send_timeout_s == 2.5
