"""An answer made again after a hand-off: what was published comes first, and only once.

A new holder of a session usually has the engine go on after the text already
published (the assistant's prefix). Two kinds of answer cannot go on that way:

- held to JSON (``response_format``): vLLM applies a grammar from the first
  token it generates, so after the JSON so far it began a second document
  (``{"name": "Al{"name": ...``);
- with a function call published in part: a call is parsed from the text the
  engine generates, so a prefix cannot hold half of one, and the call began
  again under a new id.

Those the engine makes again from the start, with the seed ``create`` stored
(one is picked when the client gave none), so the answer comes out as it began.
``SaidAgain`` holds what was published and checks each event of the new answer
against it: what was said already is dropped, what goes beyond it is passed on,
and a call keeps the id its first piece went out with. An answer that comes out
differently is ``None``: the relay fails the session rather than send it. A spoken
answer's Talker skips what the earlier holder's audio said
(``EngineRequest.spoken_chars``), so the audio is not said twice either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_adapter.port import Finished, OutputEvent, TextDelta, ToolCallDelta


@dataclass
class SaidAgain:
    #: The published text not yet said again.
    text: str = ""
    #: Each published call, by index: its name ("" if not published), and its published
    #: arguments not yet said again.
    calls: dict[int, tuple[str, str]] = field(default_factory=dict)

    def checks(self, event: OutputEvent) -> bool:
        """Whether ``event`` is to be held against what was published."""
        if isinstance(event, TextDelta):
            return bool(self.text)
        if isinstance(event, ToolCallDelta):
            return event.index in self.calls
        return isinstance(event, Finished) and self.left

    @property
    def left(self) -> bool:
        return bool(self.text) or any(arguments for _, arguments in self.calls.values())

    def after(self, event: OutputEvent) -> TextDelta | ToolCallDelta | None:
        """What of ``event`` is new (perhaps nothing); ``None`` if it is not what was published."""
        if isinstance(event, TextDelta):
            said = event.text[:len(self.text)]
            if not self.text.startswith(said):
                return None
            self.text = self.text[len(said):]
            new = event.text[len(said):]
            return TextDelta(new, event.logprobs if new else ())  # the tokens of what was said went out before
        if isinstance(event, ToolCallDelta):
            name, left = self.calls[event.index]
            said = event.arguments[:len(left)]
            if (event.name is not None and name and event.name != name) or not left.startswith(said):
                return None
            self.calls[event.index] = (name, left[len(said):])
            return ToolCallDelta(event.index, arguments=event.arguments[len(said):])  # its id went out before
        return None  # the answer ended before it said all that was published


def nothing_new(event: TextDelta | ToolCallDelta) -> bool:
    return not (event.text if isinstance(event, TextDelta) else event.arguments)
