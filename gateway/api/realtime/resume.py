"""Where a reconnecting Realtime client stopped: event ids that mark a place.

The open turn's events (and the last answer's) are made again on a reconnect by
reading their sessions' frames from the start; every event says where it stands
so the replay can mute what the client already has:

* an event made from a frame: ``event_<frame id>_<n>h<run>.<tag>``: the frame's
  n-th event, in the conversation's ``<run>``-th answer (frame ids of two sessions
  do not compare: on Redis Cluster their clocks differ);
* an event of the client's own requests (``response.created``, ``...item.added``):
  ``event_<frame id>_<n>h<run>r<number>.<tag>``, where ``<frame id>_<n>`` is the
  last frame event of run ``<run>`` sent before it and ``<number>`` counts the
  connection's request events. The latest are kept (the connection's state),
  so a client that stopped before some gets them again, each after the frame
  event it followed.

``<tag>`` is the Realtime session's own (a few characters of its id): a resume
with another session's event id is refused, not taken as a place in this one.
The release before read ``event_<frame id>_<n>`` and what follows an ``h``: it
still reads these ids (as frame places), and its own are still read here.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from gateway.store.records import event_id_key

#: An event's place in a session's output: (frame id as sortable, its index among that frame's events).
Position = tuple[tuple[int, int], int]
#: Before any frame of the turn: nothing of it is muted.
START: Position = ((0, 0), -1)
#: After every frame.
END: Position = ((2**63, 0), 0)

_INDEX = re.compile(r"(-?\d+)(?:h(?:(\d+)(?:r(\d+))?\.([0-9a-f]+)|[0-9a-f]+))?")


@dataclass(frozen=True)
class EventPlace:
    """What an event id says of where its event stands."""

    #: The answer (the conversation's count of them) its position is in; ``None`` in an old id.
    run: int | None
    position: Position
    #: A request event's number among the connection's; ``None`` for a frame event's (or an old id).
    number: int | None = None
    #: Its Realtime session's tag; ``None`` in an id of the release before.
    tag: str | None = None

    def reached(self, run: int, position: Position) -> bool:
        """Whether an event at ``position`` of run ``run`` is at or before this place."""
        if self.run is None:  # (an old id: one run at a time, as the release before compared)
            return position <= self.position
        return (run, position) <= (self.run, self.position)


#: After everything: what a client missed is all sent.
EVERYTHING = EventPlace(2**62, END)


def connection_tag(conversation_id: str) -> str:
    return hashlib.blake2s(conversation_id.encode(), digest_size=3).hexdigest()


def frame_event_id(frame_id: str, index: int, run: int, tag: str) -> str:
    return f"event_{frame_id}_{index}h{run}.{tag}"


def request_event_id(last: Position | None, last_frame_id: str | None, run: int, number: int, tag: str) -> str:
    """The id of the ``number``-th event the client's own requests caused, after frame event ``last``."""
    if last is None or last_frame_id is None:
        return f"event_0-0_-1h{run}r{number}.{tag}"
    return f"event_{last_frame_id}_{last[1]}h{run}r{number}.{tag}"


def event_place(event_id: str | None) -> EventPlace | None:
    """Where the event whose id this is stands; ``None`` for an id this server never made."""
    if not event_id or not event_id.startswith("event_"):
        return None
    frame_id, _, index = event_id[len("event_"):].partition("_")
    found = _INDEX.fullmatch(index)
    if found is None:
        return None
    try:
        key = event_id_key(frame_id)
    except ValueError:
        return None
    run, number, tag = found[2], found[3], found[4]
    return EventPlace(None if run is None else int(run), (key, int(found[1])),
                      None if number is None else int(number), tag)
