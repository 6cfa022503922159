"""``omni-gateway stream``: stream a text or WAV file to the gateway as a live client would.

Registered as a subcommand of ``omni-gateway`` (``gateway/runtime/cli.py`` adds it);
everything it does goes through :mod:`omni_client`. Exit codes: 0 done, 2
usage or an input file it cannot stream, 3 gateway unreachable, 4 request
refused (4xx), 5 server error or a failed answer, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from omni_client.async_client import DEFAULT_URL, AsyncClient, AsyncSession
from omni_client.audio import ANSWER_RATE, wav_bytes
from omni_client.errors import APIError, OmniError, ServerError, SessionFailed, TransportFailed
from omni_client.inputs import InputError, load
from omni_client.progress import Progress
from omni_client.streaming import Printer, Timing, stream

OK, USAGE, UNREACHABLE, REFUSED, FAILED, INTERRUPTED = 0, 2, 3, 4, 5, 130
URL_ENV, KEY_ENV = "OMNI_GATEWAY_URL", "OMNI_GATEWAY_API_KEY"
#: How long an interrupted run waits for its session's cancel before it exits anyway.
CANCEL_SEC = 5.0

DESCRIPTION = """\
Stream a text file or a WAV file to omni-gateway in chunks, the way a live
client would (a user typing, a microphone), print the answer as it streams,
and report the latency that matters: the first token after the end of input.
"""

EPILOG = f"""\
examples:
  # a question in a text file, three words a chunk, as fast as acknowledged
  omni-gateway stream question.txt

  # a recording, 200 ms of audio a chunk, sent in real time as it was spoken;
  # the spoken answer saved to answer.wav
  omni-gateway stream question.wav --chunk-ms 200 --realtime --save-audio answer.wav

  # typed at one word every 300 ms, with a system prompt, greedy and short
  echo "What is the capital of France?" | \\
    omni-gateway stream - --words 1 --chunk-ms 300 --realtime \\
      --system "Answer in one sentence." --temperature 0 --max-tokens 32

  # another gateway, with an API key
  {URL_ENV}=https://gw.example.com {KEY_ENV}=sk-... omni-gateway stream question.txt

The answer goes to stdout; progress (on a terminal), timing and errors go to
stderr, so `omni-gateway stream q.txt > answer.txt` keeps just the answer.

exit codes:
  0  answered          2  usage, or an input file it cannot stream
  3  gateway unreachable (after retries)
  4  request refused (4xx: bad option, unknown session, rate limit, ...)
  5  server error (5xx) or the answer failed
  130  interrupted (Ctrl-C cancels the session)
"""


def add_commands(commands: Any) -> None:
    """Add the client's subcommands to ``omni-gateway``'s subparsers."""
    parser = commands.add_parser("stream", help="stream a text or WAV file as chunks and print the answer",
                                 description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="a text file (UTF-8), a WAV file (PCM), or - for text from stdin")
    where = parser.add_argument_group("gateway")
    where.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL),
                       help=f"the gateway's base URL (env {URL_ENV}; default {DEFAULT_URL})")
    where.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                       help=f"sent as Authorization: Bearer (env {KEY_ENV})")
    where.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    pace = parser.add_argument_group("chunks and pace")
    pace.add_argument("--chunk-ms", type=_positive_int, default=200,
                      help="audio: milliseconds of audio per chunk; with --realtime also the pause "
                           "between text chunks (default 200)")
    pace.add_argument("--realtime", action="store_true",
                      help="send each chunk when it would exist live (audio as it is spoken, text at "
                           "--chunk-ms a chunk); default: as fast as the gateway acknowledges")
    pace.add_argument("--words", type=_positive_int, default=3, help="text: words per chunk (default 3)")
    pace.add_argument("--chars", type=_positive_int, help="text: characters per chunk, instead of words")
    answer = parser.add_argument_group("the answer")
    answer.add_argument("--system", help="a system prompt placed before the streamed input")
    answer.add_argument("--model", help="the served model name (default: the gateway's)")
    answer.add_argument("--max-tokens", type=_positive_int,
                        help="longest answer in tokens (unset: up to the model's context; a small model may "
                             "repeat itself until then)")
    answer.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    answer.add_argument("--start-policy", choices=["on_first_chunk", "on_min_length", "on_end_only"],
                        help="when the engine starts prefilling (default: the gateway's)")
    answer.add_argument("--save-audio", metavar="OUT.wav", type=Path,
                        help="ask for a spoken answer and save it as a WAV (24 kHz mono)")
    answer.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    parser.set_defaults(run=run_stream)


def run_stream(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        return _fail(USAGE, f"--url must start with http:// or https://, not {args.url!r}")
    try:
        chunks, kind = load(args.file, chunk_ms=args.chunk_ms, words=args.words, chars=args.chars)
    except InputError as exc:
        return _fail(USAGE, str(exc))
    body: dict[str, Any] = {key: value for key, value in (
        ("model", args.model), ("max_tokens", args.max_tokens), ("temperature", args.temperature),
        ("start_policy", args.start_policy)) if value is not None}
    if args.system:
        body["messages"] = [{"role": "system", "content": args.system}]
    if args.save_audio:
        body["modalities"] = ["text", "audio"]
    timing = Timing()
    progress = Progress(len(chunks), sys.stderr, sys.stderr.isatty() and not args.no_progress)
    opened: list[AsyncSession] = []

    async def main() -> int:
        async with AsyncClient(args.url, args.api_key, timeout=args.timeout) as client:
            try:
                session, answer = await stream(client, body, chunks, realtime=args.realtime, progress=progress,
                                               printer=Printer(sys.stdout), timing=timing,
                                               on_session=opened.append)
            except (asyncio.CancelledError, OmniError):
                # Ctrl-C (asyncio.run cancels us) or a failure: the session would otherwise
                # hold its slot until it times out; cancel it (a no-op if it already ended).
                if opened:
                    with contextlib.suppress(OmniError, TimeoutError):
                        await asyncio.wait_for(opened[0].cancel(), CANCEL_SEC)
                raise
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"session {session.id}", file=sys.stderr)
        if answer.transcript:
            print(f"heard: {answer.transcript}", file=sys.stderr)
        print(timing.report(len(chunks), kind), file=sys.stderr)
        if args.save_audio:
            if not answer.audio:
                return _fail(FAILED, "the answer has no audio to save")
            args.save_audio.write_bytes(wav_bytes(bytes(answer.audio), ANSWER_RATE))
            print(f"saved {len(answer.audio) / 2 / ANSWER_RATE:.2f} s of audio to {args.save_audio}", file=sys.stderr)
        return OK

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        where = f" (session {opened[0].id} cancelled)" if opened else ""
        return _fail(INTERRUPTED, f"interrupted{where}")
    except OmniError as exc:
        return _fail(_exit_code(exc), _message(exc, args.url))
    except OSError as exc:  # --save-audio's file
        return _fail(USAGE, f"cannot write {args.save_audio}: {exc.strerror or exc}")


def _exit_code(error: OmniError) -> int:
    if isinstance(error, TransportFailed):
        return UNREACHABLE
    if isinstance(error, SessionFailed | ServerError):
        return FAILED
    return REFUSED if isinstance(error, APIError) else FAILED


def _message(error: OmniError, url: str) -> str:
    if isinstance(error, TransportFailed):
        return f"cannot reach the gateway at {url}: {error.message}"
    if isinstance(error, SessionFailed):
        return f"the answer failed: {error.code}: {error.message}"
    if isinstance(error, APIError):
        where = f" ({error.param})" if error.param else ""
        return f"the gateway refused: {error.status} {error.code}{where}: {error.message}"
    return str(error)


def _fail(code: int, message: str) -> int:
    print(f"omni-gateway stream: {message}", file=sys.stderr)
    return code


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number
