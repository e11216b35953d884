"""Credentials in URLs and storage options: found (where they must not travel) and redacted (from every error
message and log line).

A credential hides in four places: a URL's userinfo (``https://user:password@host/run``), a URL's query (a
presigned URL's ``X-Amz-Signature=...``, an Azure SAS's ``sig=...``: parameters named as options are), a storage option
whose name says it holds one (``key``, ``secret``, ``token``, ``aws_secret_access_key``, ``password``, ...),
and an HTTP header (``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``X-Api-Key``, ``X-Auth-Token``,
...), at any depth of the options (``headers``, ``client_kwargs``, ``config_kwargs``, any mapping).
``credential_paths`` names each one found (never its value); ``redact`` gives a copy of a URL, a message or
storage options fit to be shown. Standard library only: ``errors`` redacts every message with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"
"""What a credential is replaced with in messages and logs."""

_URL = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#\s'\"<>\\]*)")
_WHOLE_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>\\]*")
_QUERY_PARAMETER = re.compile(r"(?P<name>[^=&;#]+)=(?P<value>[^&;#]*)")  # in a URL's query
# What names that hold credentials contain (s3fs's key/secret/token, botocore's aws_*, Azure's account_key and
# sas_token, HTTP's Authorization, Proxy-Authorization, Cookie, X-Api-Key, X-Auth-Token, any *password*):
_SUBSTRINGS = ("secret", "token", "password", "passwd", "passphrase", "credential", "private", "authorization",
               "cookie")
_WORDS = frozenset({"auth", "sas", "sig"})  # anywhere among the name's words
# the name's last word: api_key, X-Key, SSECustomerKey, X-Amz-Signature (not s3fs's signature_version)
_LAST_WORDS = frozenset({"key", "keys", "apikey", "signature"})
_NAMES = frozenset({"aws_access_key_id", "access_key_id"})
_AUTHORIZATION_VALUES = ("bearer ", "basic ", "digest ")  # an Authorization header's value, under any name
_HEADERS = "headers"
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")  # X-Api-Key, api_key, SSECustomerKey: their words


def is_credential_name(name: object) -> bool:
    """Whether an option or header called ``name`` holds a credential (``key``, ``aws_secret_access_key``,
    ``Authorization``, ``Cookie``, ``X-Api-Key``, ``X-Auth-Token``, ...)."""
    lowered = str(name).lower()
    words = [w.lower() for w in _WORD.findall(str(name))]
    return (lowered in _NAMES or any(s in lowered for s in _SUBSTRINGS) or not _WORDS.isdisjoint(words)
            or bool(words) and words[-1] in _LAST_WORDS)


def has_userinfo(text: str) -> bool:
    """Whether ``text`` holds a URL with userinfo (``scheme://user:password@host``, ``scheme://token@host``)."""
    return "@" in text and any("@" in match.group("authority") for match in _URL.finditer(text))


def has_query_credential(text: str) -> bool:
    """Whether ``text`` holds a URL whose query has a credential-like parameter (``X-Amz-Signature``, ``sig``,
    ``token``, ...)."""
    return "?" in text and any(is_credential_name(m.group("name")) for _, m in _query_parameters(text))


def credential_paths(value: object, path: str = "") -> list[str]:
    """Where ``value`` (storage options, a request's fields: any JSON-like value) holds credentials, each as
    a dotted path (``storage_options.headers.Authorization``), never the credential itself: credential-like
    names at any depth of mappings and lists, values that are an Authorization header's (``Bearer ...``),
    and URLs with userinfo in any string."""
    if isinstance(value, Mapping):
        found = []
        for name, item in value.items():
            where = f"{path}.{redact(str(name))}" if path else redact(str(name))
            if is_credential_name(name) or _is_authorization(item):
                found.append(where)
            else:
                found += credential_paths(item, where)
        return found
    if isinstance(value, (list, tuple)):  # (headers as [name, value] pairs too)
        found = []
        for i, item in enumerate(value):
            where = f"{path}[{i}]"
            found += [where] if _is_authorization(item) else credential_paths(item, where)
        return found
    if isinstance(value, str) and has_userinfo(value):
        return [f"{path} (user:password@ in a URL)"]
    if isinstance(value, str) and has_query_credential(value):
        return [f"{path} (a credential in a URL's query)"]
    return []


def redact(value: Any) -> Any:
    """``value`` fit for an error message or a log line: URLs without their userinfo
    (``https://***@host/run``) and with ``***`` for the values of credential-like query parameters
    (``?X-Amz-Signature=***``); in mappings, at any depth, credential-like options and every header's value
    replaced by ``***``. Lists and tuples are redacted item by item; numbers, booleans and None are kept;
    any other object (an exception, a path) becomes its redacted text."""
    if isinstance(value, str):
        if "@" in value:
            value = _URL.sub(_without_userinfo, value)
        return _redact_query(value) if "?" in value else value
    if isinstance(value, Mapping):
        return {redact(str(name)): REDACTED if is_credential_name(name) or _is_authorization(item) else
                {redact(str(h)): REDACTED for h in item} if _is_headers(name, item) else redact(item)
                for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item) for item in value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return redact(str(value))


def _is_authorization(value: object) -> bool:
    return isinstance(value, str) and value.lower().startswith(_AUTHORIZATION_VALUES)


def _is_headers(name: object, value: object) -> bool:
    return str(name).lower() == _HEADERS and isinstance(value, Mapping)


def _without_userinfo(match: re.Match[str]) -> str:
    authority = match.group("authority")
    if "@" not in authority:
        return match.group(0)
    return f"{match.group('scheme')}{REDACTED}@{authority.rsplit('@', 1)[1]}"


def _query_parameters(text: str) -> list[tuple[int, re.Match[str]]]:
    """The query parameters of the URLs in ``text``, each with the offset of its URL's query in ``text``."""
    found = []
    for url in _WHOLE_URL.finditer(text):
        start = url.group(0).find("?")
        if start < 0:
            continue
        query = url.group(0)[start + 1:].split("#", 1)[0]
        found += [(url.start() + start + 1, m) for m in _QUERY_PARAMETER.finditer(query)]
    return found


def _redact_query(text: str) -> str:
    pieces, end = [], 0
    for offset, match in _query_parameters(text):
        if is_credential_name(match.group("name")):
            pieces += [text[end:offset + match.start("value")], REDACTED]
            end = offset + match.end("value")
    return "".join(pieces) + text[end:]
