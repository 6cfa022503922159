"""Where a reconnecting Realtime client stopped: event ids that mark a position.

The open turn's events are made again on a reconnect by reading its
session's frames from the start; every event says where it stands so the
replay can mute what the client already has:

* an event made from a frame: ``event_<frame id>_<n>`` (the frame's n-th event);
* an event of the client's own requests (``response.created``, ``...item.added``):
  ``event_<frame id>_<n>h<random>``, where ``<frame id>_<n>`` is the last
  frame event sent before it. A client that stopped there has everything up
  to that frame event, and gets the frames' events after it.
"""

from __future__ import annotations

import os

from gateway.store.records import event_id_key

#: An event's place in a session's output: (frame id as sortable, its index among that frame's events).
Position = tuple[tuple[int, int], int]
#: Before any frame of the turn: nothing of it is muted.
START: Position = ((0, 0), -1)


def frame_event_id(frame_id: str, index: int) -> str:
    return f"event_{frame_id}_{index}"


def request_event_id(last: Position | None, last_frame_id: str | None) -> str:
    """The id of an event the client's own request caused, after frame event ``last``."""
    if last is None or last_frame_id is None:
        return f"event_0-0_-1h{os.urandom(6).hex()}"
    return f"event_{last_frame_id}_{last[1]}h{os.urandom(6).hex()}"


def resume_position(last_event_id: str | None) -> Position | None:
    """Where a reconnecting client stopped, from the id of the last event it saw."""
    if not last_event_id or not last_event_id.startswith("event_"):
        return None
    frame_id, _, index = last_event_id[len("event_"):].rpartition("_")
    index = index.partition("h")[0]
    try:
        return event_id_key(frame_id), int(index)
    except ValueError:
        return None
