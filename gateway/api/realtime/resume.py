"""Where a reconnecting Realtime client stopped: event ids that mark a place.

The open turn's events are made again on a reconnect by reading its
session's frames from the start; every event says where it stands so the
replay can mute what the client already has:

* an event made from a frame: ``event_<frame id>_<n>.<tag>`` (the frame's n-th event);
* an event of the client's own requests (``response.created``, ``...item.added``):
  ``event_<frame id>_<n>r<number>.<tag>``, where ``<frame id>_<n>`` is the last
  frame event sent before it and ``<number>`` counts the connection's request
  events. Those are kept (the latest few, in the connection's state), so a
  client that stopped before some of them gets them again, each after the
  frame event it followed.

``<tag>`` is the Realtime session's own (a few characters of its id): a resume
with another session's event id is refused, not taken as a place in this one.
Ids of the release before (``h<random>`` and no tag) are still read.
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

_INDEX = re.compile(r"(-?\d+)(?:r(\d+)|h[0-9a-f]+)?")


@dataclass(frozen=True)
class EventPlace:
    """What an event id says of where its event stands."""

    position: Position
    #: A request event's number among the connection's; ``None`` for a frame event's (or an old id).
    number: int | None
    #: Its Realtime session's tag; ``None`` in an id of the release before.
    tag: str | None


def connection_tag(conversation_id: str) -> str:
    return hashlib.blake2s(conversation_id.encode(), digest_size=3).hexdigest()


def frame_event_id(frame_id: str, index: int, tag: str) -> str:
    return f"event_{frame_id}_{index}.{tag}"


def request_event_id(last: Position | None, last_frame_id: str | None, number: int, tag: str) -> str:
    """The id of the ``number``-th event the client's own requests caused, after frame event ``last``."""
    if last is None or last_frame_id is None:
        return f"event_0-0_-1r{number}.{tag}"
    return f"event_{last_frame_id}_{last[1]}r{number}.{tag}"


def event_place(event_id: str | None) -> EventPlace | None:
    """Where the event whose id this is stands; ``None`` for an id this server never made."""
    if not event_id or not event_id.startswith("event_"):
        return None
    body, _, tag = event_id[len("event_"):].partition(".")
    frame_id, _, index = body.rpartition("_")
    found = _INDEX.fullmatch(index)
    if found is None:
        return None
    try:
        key = event_id_key(frame_id)
    except ValueError:
        return None
    return EventPlace((key, int(found[1])), int(found[2]) if found[2] else None, tag or None)


def resume_position(last_event_id: str | None) -> Position | None:
    """Where a reconnecting client stopped, from the id of the last event it saw."""
    place = event_place(last_event_id)
    return None if place is None else place.position
