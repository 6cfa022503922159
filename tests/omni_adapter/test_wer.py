"""Word error rate of the Listener on 24 spoken clips, clean and noisy, fed as clients feed them.

Goals (issue 28): at most 3 % clean and 8 % with noise 15 dB below the
speech, both for 200 ms chunks at 24 kHz and 20 ms frames at 48 kHz. The
figures and the misses are in bench/README.md (bench/voice.py measures them
the same way).
"""

from __future__ import annotations

from tests.wer import FEEDS, make_clips, measure

GOALS = {"clean": 0.03, "noisy": 0.08}


async def test_the_listener_hears_questions_and_commands_clean_and_in_noise() -> None:
    clips = make_clips()
    assert len(clips) >= 24
    tallies, misses = await measure(clips)
    report = {f"{condition}, {feed}": f"{t.rate:.1%} of {t.words} words" for (condition, feed), t in tallies.items()}
    for condition, goal in GOALS.items():
        for feed, _, _ in FEEDS:
            assert tallies[(condition, feed)].rate <= goal, (report, misses)
