"""Credentials out of URLs, wherever a URL is shown: logs, events, errors, a config's repr; and
out of the debug logs of the libraries that talk to storage.

Only the standard library: ``elastic.config`` uses it, and the config is imported where neither
fsspec nor torch may be (the actor classes' modules, see elastic/_lazy.py).
"""

from __future__ import annotations

import logging
import re

# The user:password@ of a URL. A password may hold '/' (AWS secret keys often do), so once a ':'
# follows the user name, the userinfo runs to the last '@' before whitespace: that redacts too
# much of a text like ``https://host:8080/a@b`` rather than too little of a secret. Without a ':'
# it stops at the first '/', so a path such as ``s3://bucket/key@v1/x`` is left as it is.
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
USERINFO = re.compile(rf"(?P<scheme>{_SCHEME})(?P<userinfo>[^/@\s:]*:\S*|[^/@\s]*)@")
_QUERY = re.compile(r"\?.*$")
# A URL's query string inside other text: up to whitespace or a character no URL holds unescaped
# (a quote or an angle bracket), so the text around the URL stays readable.
_URL_QUERY = re.compile(rf"(?P<url>{_SCHEME}[^\s?'\"<>]*)\?[^\s'\"<>]+")


def _redact_userinfo(text: str) -> str:
    return USERINFO.sub(r"\g<scheme>***@", text)


def redact_url(url: str) -> str:
    """A URL without user:password@ and without a query string (presigned URLs carry signatures there)."""
    return _QUERY.sub("", _redact_userinfo(url))


def redact_urls_in(text: str) -> str:
    """``text`` with every URL in it redacted as ``redact_url`` does, the text around them kept."""
    # Userinfo first: a password may hold a '?', which would otherwise start a "query".
    return _URL_QUERY.sub(r"\g<url>", _redact_userinfo(text))


# Loggers that at DEBUG print each request with its signed headers and what went into the
# signature (botocore's canonical request: x-amz-security-token, Authorization's Credential=the
# access key id). No Redactor sees those lines, so our debug logging leaves them at INFO.
CREDENTIAL_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3transfer", "s3fs", "urllib3", "aiohttp")


def configure_logging(level: int | str, **kwargs) -> None:
    """``logging.basicConfig(level=level, ...)``, but no lower than INFO for ``CREDENTIAL_LOGGERS``:
    ``elastic -v`` or ``ELASTIC_LOG_LEVEL=DEBUG`` debugs elastic, not S3's request signing."""
    logging.basicConfig(level=level, **kwargs)
    for name in CREDENTIAL_LOGGERS:
        lib = logging.getLogger(name)
        if lib.getEffectiveLevel() < logging.INFO:
            lib.setLevel(logging.INFO)
