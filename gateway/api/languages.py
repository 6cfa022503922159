"""The languages the recognizer hears, for every door that names one.

The engine's Listener is Moonshine base-en: a transcript of French audio would be
English-sounding nonsense, so another language is refused with its name, not heard
wrongly. ``en-US`` and ``EN`` are English too.
"""

from __future__ import annotations

from gateway import errors

#: ISO-639-1 codes.
LANGUAGES = frozenset({"en"})


def check_heard(language: str, param: str) -> None:
    """A 400 when ``language`` is not one the recognizer hears."""
    if language.split("-")[0].lower() not in LANGUAGES:
        raise errors.InvalidRequest(f"language {language!r} is not heard here (the recognizer hears: "
                                    f"{', '.join(sorted(LANGUAGES))})", param=param)
