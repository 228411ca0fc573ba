"""Credentials out of logs and messages: the debug logs of S3's libraries in every process that
opens storage, and the gaps of the redaction of text (``redact_urls_in``, ``Redactor``)."""

from __future__ import annotations

import json
import logging
from urllib.parse import quote

import pytest

from elastic.checkpoint.storage import Redactor, RetryPolicy, Storage
from elastic.checkpoint.testing import MotoS3
from elastic.redact import CREDENTIAL_LOGGERS, quiet_credential_loggers, redact_urls_in

KEY_ID = "AKIAREDACTIONTEST012"  # the form of an access key id: AKIA and 16 more
TOKEN = "FwoGZXIvYXdzEREDACTION/token+value=="


@pytest.fixture
def fresh_loggers(monkeypatch):
    """S3's libraries' loggers as a process that never called ``configure_logging`` has them (a
    rank, a node agent, the driver): no level of their own, no filter. Put back afterwards."""
    for name, lib in list(logging.root.manager.loggerDict.items()):
        if isinstance(lib, logging.Logger) and name.split(".")[0] in CREDENTIAL_LOGGERS:
            monkeypatch.setattr(lib, "level", logging.NOTSET)
            monkeypatch.setattr(lib, "filters", [])
    logging.root.manager._clear_cache()
    yield
    logging.root.manager._clear_cache()


@pytest.fixture(scope="module")
def moto():
    server = MotoS3().start()
    yield server
    server.stop()


def s3_storage(moto) -> Storage:
    options = dict(moto.storage_options(), key=KEY_ID, token=TOKEN)
    return Storage(f"s3://{moto.create_bucket()}/run", options, retry=RetryPolicy(attempts=1))


def leaked(records) -> list[str]:
    return [f"{r.name}: {r.getMessage()[:200]}" for r in records
            if KEY_ID in r.getMessage() or "FwoGZXIvYXdzEREDACTION" in r.getMessage()]


def test_s3_requests_log_no_credentials_with_the_root_logger_at_debug(moto, fresh_loggers, caplog):
    # A rank's checkpoint writer with logging.basicConfig(level=DEBUG) or Ray's
    # LoggingConfig(log_level="DEBUG"): botocore.endpoint printed each request's headers
    # (X-Amz-Security-Token, Authorization's Credential=<access key id>) and botocore.auth the
    # canonical request, as no process but the CLI and the controller quieted them.
    storage = s3_storage(moto)
    caplog.set_level(logging.DEBUG)  # the root logger and its handler
    storage.write_bytes("step-000000001/a.bin", b"alpha")
    assert storage.read_bytes("step-000000001/a.bin") == b"alpha"
    assert not leaked(caplog.records)
    # DEBUG asked for again, later, of botocore itself and of the root: still nothing.
    logging.getLogger("botocore").setLevel(logging.DEBUG)
    try:
        storage.write_bytes("step-000000001/b.bin", b"beta")
        assert storage.read_bytes("step-000000001/b.bin") == b"beta"
    finally:
        logging.getLogger("botocore").setLevel(logging.INFO)
    assert not leaked(caplog.records)


def test_the_quieted_loggers_stay_quiet_whatever_level_is_set_later(fresh_loggers, caplog, monkeypatch):
    # Quieted while the root logger is at its default, as a process opens storage before anyone
    # asks for DEBUG; then DEBUG on the root, and on the libraries themselves.
    names = ("botocore.endpoint", "botocore.auth", "botocore.hooks", "s3fs", "urllib3.connectionpool")
    for name in names:
        logging.getLogger(name)
    monkeypatch.setattr(logging.root, "level", logging.WARNING)
    logging.root.manager._clear_cache()
    quiet_credential_loggers()
    caplog.set_level(logging.DEBUG)  # the root at DEBUG, after
    late = logging.getLogger("botocore.made_after_the_call")  # no filter of its own: its parent's level
    late.debug("x-amz-security-token:%s", TOKEN)
    for name in names:
        logging.getLogger(name).debug("x-amz-security-token:%s Credential=%s", TOKEN, KEY_ID)
    # A filter on "botocore" would see only the records made on "botocore" itself, not on its
    # children, which are where botocore logs: each child has its own.
    for family in ("botocore", "s3fs", "urllib3"):
        logging.getLogger(family).setLevel(logging.DEBUG)
    logging.getLogger("botocore.auth").setLevel(logging.DEBUG)
    try:
        for name in names:
            logging.getLogger(name).debug("x-amz-security-token:%s Credential=%s", TOKEN, KEY_ID)
            logging.getLogger(name).warning("%s still warns", name)
    finally:
        for family in ("botocore", "s3fs", "urllib3"):
            logging.getLogger(family).setLevel(logging.INFO)
        logging.getLogger("botocore.auth").setLevel(logging.NOTSET)
    assert not leaked(caplog.records)
    assert [r.getMessage() for r in caplog.records] == [f"{name} still warns" for name in names]
    quiet_credential_loggers()  # again: nothing added twice
    assert len(logging.getLogger("botocore.endpoint").filters) == 1


def test_botocores_own_debug_lines_are_redacted_as_text(moto, fresh_loggers, monkeypatch):
    # The lines themselves, for wherever such text reaches a message: a signed request's headers
    # and canonical request, with the token, the key id and the signature in them.
    import elastic.redact

    monkeypatch.setattr(elastic.redact, "quiet_credential_loggers", lambda: None)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(logging.DEBUG)
    for name in ("botocore.endpoint", "botocore.auth"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.DEBUG)
        logging.getLogger(name).addHandler(handler)
    try:
        s3_storage(moto).write_bytes("a.bin", b"alpha")
    finally:
        for name in ("botocore.endpoint", "botocore.auth"):
            logging.getLogger(name).removeHandler(handler)
    signed = [line for line in lines if KEY_ID in line or TOKEN in line]
    assert any("Authorization" in line for line in signed) and any("x-amz-security-token:" in line for line in signed)
    for line in signed:
        text = redact_urls_in(line)
        assert KEY_ID not in text and TOKEN not in text, text


def test_credential_headers_in_escaped_json_and_set_cookie_are_redacted():
    # JSON inside a JSON string escapes its quotes, and Set-Cookie's "set-" kept "cookie" from
    # matching: both passed through as they were.
    from elastic.redact import carries_credentials

    escaped = json.dumps(json.dumps({"authorization": "Bearer tok123"}))
    for text, secret in ((escaped, "tok123"), ("Set-Cookie: session=abc123; Path=/", "abc123")):
        assert carries_credentials(text) and secret not in redact_urls_in(text), text
    assert redact_urls_in("authorization failed: no token") == "authorization failed: no token"


def test_signed_query_parameters_and_credential_headers_are_redacted_without_a_url():
    cases = {
        "GET /bkt/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA0123%2F20240101%2Fus-east-1"
        "&X-Amz-Security-Token=FwoGtok%2B&X-Amz-Signature=9f8e7d HTTP/1.1":
            "GET /bkt/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Security-Token=***"
            "&X-Amz-Signature=*** HTTP/1.1",
        "/bkt/k?AWSAccessKeyId=AKIA0123&Expires=1700000000&Signature=abc%3D":
            "/bkt/k?AWSAccessKeyId=***&Expires=1700000000&Signature=***",
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIA0123/20240101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=9f8e7d": "Authorization: ***",
        "proxy-authorization: Bearer eyJhbGciOi.x": "proxy-authorization: ***",
        # Ray's token auth: its header, its dashboard cookie (in a Cookie header, or on its own)
        "X-Ray-Authorization: Bearer 3f9a0c1d2e": "X-Ray-Authorization: ***",
        "Cookie: ray-authentication-token=3f9a0c1d2e; theme=dark": "Cookie: ***",
        "set ray-authentication-token=3f9a0c1d2e; path=/": "set ray-authentication-token=***; path=/",
        "X-Amz-Security-Token: FwoGZXIvYXdzE\nX-Amz-Date: 20240101T000000Z":
            "X-Amz-Security-Token: ***\nX-Amz-Date: 20240101T000000Z",
        "headers={'X-Amz-Security-Token': b'FwoGZXIvYXdzE', 'Authorization': b'AWS4-HMAC-SHA256 Credential=x'}":
            "headers={'X-Amz-Security-Token': b'***', 'Authorization': b'***'}",
        "host:bkt.s3.amazonaws.com\nx-amz-security-token:FwoGZXIvYXdzE\n":
            "host:bkt.s3.amazonaws.com\nx-amz-security-token:***\n",
        f"the access key {KEY_ID} was refused": "the access key *** was refused",
        # Google Cloud Storage's V4 signing and an Azure SAS token, in a request line
        "GET /b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=svc%40p.iam&X-Goog-Signature=deadbeef":
            "GET /b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=***&X-Goog-Signature=***",
        "PUT /c/blob?sv=2022-11-02&se=2030-01-01&sp=rw&sig=SECRETSIG%3D HTTP/1.1":
            "PUT /c/blob?sv=2022-11-02&se=2030-01-01&sp=rw&sig=*** HTTP/1.1",
    }
    for text, expected in cases.items():
        assert redact_urls_in(text) == expected
        assert Redactor(None)(text) == expected


def test_ordinary_text_paths_and_urls_come_out_unchanged():
    redact = Redactor({"key": "AKIAFAKE", "secret": "s3cr3t-value", "anon": False, "use_ssl": True,
                       "endpoint_url": "http://127.0.0.1:9000", "client_kwargs": {"region_name": "eu-west-1"}})
    texts = [
        "authorization failed for this request; check the credentials",
        "Credentials: none found (AWS_PROFILE unset)",
        "signature mismatch: sha256 of step-000000001/shard-r0-of-2.safetensors",
        "s3://bucket/runs/step-000000003/manifest.json",
        "s3://bucket/key@v1/x and https://host:8080/a/b.bin",
        "/tmp/ckpt/run-1/step-000000001/manifest.json",
        "GET /bkt/k?versionId=3&partNumber=2 HTTP/1.1",
        "endpoint http://127.0.0.1:9000 in eu-west-1, anon=False use_ssl=True",
        "X-Amz-Date: 20240101T000000Z, x-amz-content-sha256:UNSIGNED-PAYLOAD",
        "key=value pairs; token count 1234; AKIA is a prefix",
        # Azure's container@account is a name, not a credential (adlfs, Hadoop's wasb)
        "abfs://ckpts@acct.dfs.core.windows.net/runs/step-000000001",
        "wasbs://data@acct.blob.core.windows.net/x; sig mismatch: sig=",
    ]
    for text in texts:
        assert redact_urls_in(text) == text
        assert redact(text) == text


def test_secrets_under_any_credential_key_in_pairs_and_bytes_are_redacted():
    options = {"passphrase": "correct-horse-battery", "pwd": "hunter2-pwd", "bearer_token": "brr-123456",
               "client_kwargs": {"headers": [("Authorization", "Bearer eyJpairs.x"), ("X-Trace", "trace-visible")]},
               "token": b"bytes-token-0123", "anon": False, "use_ssl": True, "endpoint_url": "http://127.0.0.1:9000"}
    text = Redactor(options)(f"failed with {options}")
    for secret in ("correct-horse-battery", "hunter2-pwd", "brr-123456", "eyJpairs.x", "bytes-token-0123"):
        assert secret not in text, text
    assert "trace-visible" in text and "http://127.0.0.1:9000" in text and "'anon': False" in text


def test_a_secret_is_redacted_percent_encoded_and_json_escaped():
    secret = 'wJalr/XUtn+FEMI"K7=='
    redact = Redactor({"secret": secret})
    for form in (quote(secret, safe=""), quote(secret), json.dumps(secret)[1:-1], repr(secret)[1:-1]):
        assert redact(f"body {form} end") == "body *** end", form
    assert redact(json.dumps({"aws_secret_access_key": secret})) == '{"aws_secret_access_key": "***"}'


def test_s3_storage_hides_the_aws_credentials_of_the_environment(monkeypatch):
    # No key in storage_options: botocore signs with the process's AWS_* variables, and its
    # errors (or a repr of the request) could show them.
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": "env-secret/value+0123", "AWS_SESSION_TOKEN": TOKEN}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    storage = Storage("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9"}, retry=RetryPolicy(attempts=1))
    storage.full_path()  # the filesystem, made without a request
    text = storage.redact(f"failed: {env} {quote(env['AWS_SECRET_ACCESS_KEY'], safe='')}")
    for value in env.values():
        assert value not in text and quote(value, safe="") not in text, text
    local = Storage("memory://redaction-env", {})
    local.full_path()
    assert local.redact("nothing secret here") == "nothing secret here"


def test_azure_container_urls_are_no_credential_and_their_user_password_is():
    from elastic.checkpoint.storage import _url_secrets
    from elastic.redact import carries_credentials

    url = "abfs://data@acct.dfs.core.windows.net/runs"
    # The container name is not a secret: "data" in messages stayed readable.
    assert not carries_credentials(url) and _url_secrets(url) == ()
    assert Redactor(None, _url_secrets(url))("no data_position in the data loader") == \
        "no data_position in the data loader"
    with_password = "abfss://user:pa55@acct.dfs.core.windows.net/runs"
    assert carries_credentials(with_password) and set(_url_secrets(with_password)) >= {"user", "pa55"}
    assert redact_urls_in(with_password) == "abfss://***@acct.dfs.core.windows.net/runs"
    # Any other scheme's name@host is still taken for a credential (a token as the user name).
    assert carries_credentials("https://ghp_token@github.com/x")
