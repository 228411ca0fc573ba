"""Credentials out of URLs, wherever a URL is shown: logs, events, errors, a config's repr; out of
the signed requests that S3's libraries print (presigned query parameters, Authorization and
security-token headers); and out of the debug logs of the libraries that talk to storage.

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
# Schemes whose ``name@host`` is no credential: Azure's ``abfs://container@account.dfs.core.
# windows.net/path`` (adlfs, Hadoop's wasb) names a container there. Their user:password@ is.
CONTAINER_AT_HOST = frozenset({"abfs", "abfss", "az", "adl", "wasb", "wasbs"})


def is_credential(m: re.Match) -> bool:
    """Whether a ``USERINFO`` match is a credential: not an Azure container (``CONTAINER_AT_HOST``)."""
    return ":" in m.group("userinfo") or m.group("scheme")[:-3].lower() not in CONTAINER_AT_HOST
_QUERY = re.compile(r"\?.*$")
# A URL's query string inside other text: up to whitespace or a character no URL holds unescaped
# (a quote or an angle bracket), so the text around the URL stays readable.
_URL_QUERY = re.compile(rf"(?P<url>{_SCHEME}[^\s?'\"<>]*)\?[^\s'\"<>]+")
# What signs a request, where no URL with a scheme is in front to lose its query: a presigned
# path as botocore and s3fs log it (``GET /bkt/k?X-Amz-Credential=AKIA...&X-Amz-Signature=...``),
# SigV2's ``AWSAccessKeyId=`` and ``Signature=``, and the ``Credential=<access key id>`` and
# ``Signature=`` of an Authorization header. The value ends where a query's or a header's next
# field starts. Not after a letter or '-' (``X-Amz-Signature`` matches whole, ``mysignature=`` not).
# Google Cloud Storage's V4 signing (``X-Goog-Credential``, ``X-Goog-Signature``) and an Azure SAS
# token's ``sig=`` are the same in other clouds' requests; ``sig`` only as a query parameter,
# after '?' or '&' (the word is common).
SIGNED_PARAM = re.compile(r"(?i)(?:(?<![\w-])(?P<name>x-(?:amz|goog)-(?:credential|signature|security-token)|"
                          r"credential|signature|awsaccesskeyid|ray-authentication-token)|(?<=[?&])(?P<sas>sig))"
                          r"=(?P<value>[^&\s'\",;<>]+)")
# A header that is a credential, as an HTTP dump (``Authorization: AWS4-HMAC-SHA256 ...``),
# botocore's repr of a request's headers (``'X-Amz-Security-Token': b'...'``) or its canonical
# request (``x-amz-security-token:...``) shows it: the value runs to its closing quote or the
# end of the line. Only with a ':', so "authorization failed" stays as it is. Ray's token auth
# (2.60) sends its token as ``X-Ray-Authorization: Bearer ...`` (or ``Authorization``) and in the
# dashboard's ``ray-authentication-token`` cookie: a Cookie header is hidden whole.
# Also as JSON inside a JSON string (``{\\"authorization\\": \\"Bearer ...\\"}``: its quotes
# escaped), and Set-Cookie (a response's session).
CREDENTIAL_HEADER = re.compile(r"(?i)(?<![\w-])(?P<name>(?:proxy-|x-ray-)?authorization|x-amz-security-token|"
                               r"(?:set-)?cookie)"
                               r"(?P<sep>\\?['\"]?[ \t]*:[ \t]*(?:b?\\?['\"])?)(?P<value>[^'\"\\\r\n]+)")
# An AWS access key id on its own (AKIA... long-term, ASIA... temporary): 20 characters of a
# form ordinary text does not take.
_ACCESS_KEY_ID = re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")


def _redact_userinfo(text: str) -> str:
    return USERINFO.sub(lambda m: m.group("scheme") + "***@" if is_credential(m) else m.group(0), text)


def redact_url(url: str) -> str:
    """A URL without user:password@ and without a query string (presigned URLs carry signatures there)."""
    return _QUERY.sub("", _redact_userinfo(url))


def redact_urls_in(text: str) -> str:
    """``text`` with every URL in it redacted as ``redact_url`` does, the text around them kept;
    and the signing of a request (``SIGNED_PARAM``, ``CREDENTIAL_HEADER``, an access key id)
    hidden where no URL carries it."""
    # Userinfo first: a password may hold a '?', which would otherwise start a "query".
    text = _URL_QUERY.sub(r"\g<url>", _redact_userinfo(text))
    text = SIGNED_PARAM.sub(lambda m: f"{m.group('name') or m.group('sas')}=***", text)
    text = CREDENTIAL_HEADER.sub(r"\g<name>\g<sep>***", text)
    return _ACCESS_KEY_ID.sub("***", text)


def carries_credentials(text: str) -> bool:
    """Whether ``text`` holds a credential that ``redact_urls_in`` would hide: a URL's
    user:password@, a signed query parameter, an Authorization or security-token header, an
    AWS access key id. A URL's other query parameters are no credential."""
    return (any(is_credential(m) for m in USERINFO.finditer(text))
            or any(p.search(text) for p in (SIGNED_PARAM, CREDENTIAL_HEADER, _ACCESS_KEY_ID)))


# Loggers that at DEBUG print each request with its signed headers and what went into the
# signature (botocore's canonical request: x-amz-security-token, Authorization's Credential=the
# access key id). No Redactor sees those lines, so they stay at INFO in every process.
CREDENTIAL_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3transfer", "s3fs", "urllib3", "aiohttp")
_FAMILIES = tuple(f"{name}." for name in CREDENTIAL_LOGGERS)


class _BelowInfo(logging.Filter):
    """Drops a record below INFO, whatever level its logger was set to later."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO


_BELOW_INFO = _BelowInfo()


def quiet_credential_loggers() -> None:
    """No record below INFO from ``CREDENTIAL_LOGGERS`` and their children, in this process.

    Called wherever storage is opened (``Storage._filesystem``), since the ranks' writers, the
    node agents and the driver log with whatever the user or Ray set (``logging.basicConfig(
    level=DEBUG)``, ``ray.LoggingConfig(log_level="DEBUG")``), not with ``configure_logging``.

    Two guards, as neither covers everything alone:
    - each family's logger gets a level of its own, INFO or the higher one it has from its
      parents now (WARNING under a default root): a root set to DEBUG later no longer reaches
      it, and a child logger without a level of its own (botocore's are) creates no DEBUG
      record, even one made after this call. The cost: a root lowered to INFO later does not
      show these libraries' INFO lines either;
    - a filter on every logger of the families that exists now (``botocore.endpoint``,
      ``botocore.auth``, ...: made when s3fs is imported): a logger's filter sees only the records
      made on it, not its children's, so each needs its own. It drops the DEBUG record made
      when a family's level is set to DEBUG later (``boto3.set_stream_logger``).
    Cheap and idempotent: a scan of the logger names, and ``addFilter`` adds a filter once."""
    for name in CREDENTIAL_LOGGERS:
        lib = logging.getLogger(name)
        if lib.level == logging.NOTSET or lib.level < logging.INFO:
            lib.setLevel(max(logging.INFO, lib.getEffectiveLevel()))
    for name, lib in list(logging.root.manager.loggerDict.items()):
        if isinstance(lib, logging.Logger) and (name in CREDENTIAL_LOGGERS or name.startswith(_FAMILIES)):
            lib.addFilter(_BELOW_INFO)


def configure_logging(level: int | str, **kwargs) -> None:
    """``logging.basicConfig(level=level, ...)``, but nothing below INFO from ``CREDENTIAL_LOGGERS``:
    ``elastic -v`` or ``ELASTIC_LOG_LEVEL=DEBUG`` debugs elastic, not S3's request signing."""
    logging.basicConfig(level=level, **kwargs)
    quiet_credential_loggers()
