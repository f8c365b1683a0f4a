"""Files the command line names (a token, a certificate), read once with an error that names the flag."""

from __future__ import annotations

from pathlib import Path

from sequence_ai_ros.exceptions import ConfigError


def read_file(path: str, flag: str) -> bytes:
    """The bytes of the file ``path`` that ``flag`` names.

    :raises ConfigError: naming the flag and the file when it is missing, a folder or unreadable.
    """
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f'{flag} {path}: {exc.strerror or exc}') from None


def read_token(path: str | None, flag: str = '--token-file') -> str | None:
    """The token in the file ``path`` (stripped), or None without one.

    :raises ConfigError: for a file that is missing, unreadable, not text, or empty.
    """
    if path is None:
        return None
    try:
        token = read_file(path, flag).decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f'{flag} {path}: not a text file (a token is one line of text)') from None
    if not token:
        raise ConfigError(f'token file {path} is empty')
    return token


__all__ = ['read_file', 'read_token']
