"""Keeping secrets off disks and consoles.

Credentials belong in the environment of the processes that use them (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``R2_*``; ``~/.netrc`` or ``NETRC`` for ``http(s)://``), never in a config. What a user does write into one anyway is
masked wherever this trainer writes or prints it:

* in a URL, the password or token of its user part (``https://user:***@host/...``, ``https://***@host/...``) and the
  value of every query parameter (presigned URLs carry their signature there: ``?X-Amz-Signature=***``);
* the value of an environment variable that a config read with ``${oc.env:NAME}`` (:func:`note_env_value`), which
  :func:`redact_text` writes back as ``${oc.env:NAME}``.

:func:`redact_text` applies both to any text: log records pass through :class:`RedactingFilter` and the one-paragraph
errors through it too, so a third-party error that quotes a URL (botocore naming an endpoint that holds credentials)
is masked like our own messages.
"""

from __future__ import annotations

import logging
import re
import threading

from ..exceptions import set_message_filter

__all__ = [
    "redact_url",
    "redact_urls",
    "redact_text",
    "note_env_value",
    "RedactingFilter",
    "url_credentials",
    "MASK",
]

MASK = "***"

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#@]*)@")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_MIN_ENV_SECRET = 6
"""Environment values shorter than this are not masked in free text: replacing a short value ("1", "gpu") wherever it
appears would garble messages; credentials are longer."""

_env_values: dict[str, str] = {}
_lock = threading.Lock()


def url_credentials(url: str) -> tuple[str, str] | None:
    """``(user, password)`` of ``scheme://user:password@host/...`` (``(token, "")`` for ``scheme://token@host/...``);
    None when the URL has no user part."""
    match = _USERINFO.match(url)
    if match is None:
        return None
    from urllib.parse import unquote

    user, _, password = match.group(2).partition(":")
    return unquote(user), unquote(password)


def redact_url(url: str) -> str:
    """``url`` fit for a file or a console: the secret of its user part (the password of ``user:password@``, all of
    ``token@``) and the values of its query string replaced by ``***``; the scheme, host and path kept."""
    match = _USERINFO.match(url)
    if match is not None:
        user, colon, _ = match.group(2).partition(":")
        userinfo = f"{user}:{MASK}" if colon else MASK
        url = f"{match.group(1)}{userinfo}@{url[match.end() :]}"
    head, sep, query = url.partition("?")
    if not sep:
        return url
    query, hash_sign, fragment = query.partition("#")
    masked = "&".join(f"{kv.partition('=')[0]}={MASK}" if "=" in kv else kv for kv in query.split("&"))
    return f"{head}?{masked}{hash_sign}{fragment}"


def note_env_value(name: str, value: str | None) -> None:
    """Remember that a config read ``value`` from the environment variable ``name``, so that :func:`redact_text`
    masks it."""
    if value is not None and len(value) >= _MIN_ENV_SECRET:
        with _lock:
            _env_values[value] = name


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url` and every noted environment value replaced by
    ``${oc.env:NAME}``."""
    with _lock:
        env = sorted(_env_values.items(), key=lambda item: -len(item[0]))  # longest first: one may contain another
    for value, name in env:
        if value in text:
            text = text.replace(value, f"${{oc.env:{name}}}")
    return redact_urls(text)


def redact_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


class RedactingFilter(logging.Filter):
    """Masks secrets (see :func:`redact_text`) in every record a handler emits, ours and third parties'."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the handler's to report
            return True
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


set_message_filter(redact_text)
