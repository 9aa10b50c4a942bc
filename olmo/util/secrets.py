"""Keeping secrets off disks and consoles.

Credentials belong in the environment of the processes that use them (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``R2_*``; ``~/.netrc`` or ``NETRC`` for ``http(s)://``), never in a config. What a user does write into one anyway is
masked wherever this trainer writes or prints it:

* in a URL, the password or token of its user part (``https://user:***@host/...``, ``https://***@host/...``) and the
  value of every query parameter (presigned URLs carry their signature there: ``?X-Amz-Signature=***``);
* the value of an environment variable that a config read with ``${oc.env:NAME}`` (:func:`note_env_value`), which
  :func:`redact_text` writes back as ``${oc.env:NAME}``; and, since such a value is often a path that errors print
  in other forms, every path derived from it: the value normalized (a trailing or doubled slash, ``./``), made
  absolute or resolved through its links (each written back as ``${oc.env:NAME}``), and each folder above it, printed
  as a path of its own (a parent named in an error: ``${oc.env:NAME}/..``, ``${oc.env:NAME}/../..``); the folder
  holding the value also where a path starts (a sibling listed in an error: ``${oc.env:NAME}/../step5``).

:func:`redact_text` applies both to any text: log records pass through :class:`RedactingFilter` and the one-paragraph
errors through it too, so a third-party error that quotes a URL (botocore naming an endpoint that holds credentials)
is masked like our own messages.
"""

from __future__ import annotations

import logging
import os
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
"""Text to mask wherever it appears -> what to write instead (``${oc.env:NAME}``)."""
_env_folders: dict[str, str] = {}
"""Folders above a value read from the environment -> what to write instead (``${oc.env:NAME}/..``): masked where
they appear as a whole path (the folder holding the value also as the start of a longer one), never inside a word."""
_lock = threading.Lock()
_PATH_CHAR = r"[\w~-]"


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
    masks it and every path derived from it (see the module's docs)."""
    if value is None or len(value) < _MIN_ENV_SECRET:
        return
    shown = f"${{oc.env:{name}}}"
    forms, folders = _path_forms(value)
    with _lock:
        # A value ending in a slash keeps it: ${oc.env:NAME}/file reads as the config wrote it.
        _env_values[value] = shown + "/" if value.endswith("/") and len(value) > 1 else shown
        _env_values.update((form, shown) for form in forms if len(form) >= _MIN_ENV_SECRET)
        _env_folders.update((f, shown + "/.." * up) for f, up in folders.items() if len(f) >= _MIN_ENV_SECRET)


def _path_forms(value: str) -> tuple[set[str], dict[str, int]]:
    """The other spellings of ``value`` as a path (normalized, absolute, resolved), and the folders above each, with
    how many levels up they are; only folders made of ``value``'s own parts (a relative value's absolute form is not
    followed up into the working directory). Nothing for a URL (:func:`redact_urls` masks what it must)."""
    if "://" in value or "\0" in value:
        return set(), {}
    normal = os.path.normpath(os.path.expanduser(value))
    forms = {value.rstrip("/") or value, normal, os.path.abspath(normal)}
    try:
        forms.add(os.path.realpath(normal))
    except (OSError, ValueError):
        pass
    own_parts = len([p for p in normal.split("/") if p not in ("", ".")])
    folders: dict[str, int] = {}
    for form in forms:
        head = form
        for up in range(1, own_parts):
            head = os.path.dirname(head)
            if head in ("", "/"):
                break
            folders.setdefault(head, up)
    return forms - {value}, {f: up for f, up in folders.items() if f not in forms}


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`, every noted environment value (and its other
    spellings as a path) replaced by ``${oc.env:NAME}``, and a folder above one, printed as a path of its own, by
    ``${oc.env:NAME}/..``."""
    with _lock:
        env = sorted(_env_values.items(), key=lambda item: -len(item[0]))  # longest first: one may contain another
        folders = sorted(_env_folders.items(), key=lambda item: -len(item[0]))
    for value, shown in env:
        if value in text:
            text = text.replace(value, shown)
    for folder, shown in folders:
        if folder in text:
            # The folder holding the value also where a longer path starts (its siblings, listed in an error); one
            # higher up only as a whole path, as it starts many paths that have nothing to do with the value.
            after = "" if shown.endswith("}/..") else "|/"
            whole = re.compile(rf"(?<!{_PATH_CHAR}|[./]){re.escape(folder)}(?!{_PATH_CHAR}{after}|\.\w)")
            text = whole.sub(shown.replace("\\", r"\\"), text)
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
