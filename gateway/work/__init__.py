"""A session's engine work: who runs it, and when.

A session's input, state and output live in Redis; its *engine work* (feed
the input to an engine session, relay the answer back to Redis) runs in
exactly one replica at a time, the holder of the session's lease. A replica
takes the lease when a call it serves makes the start policy fire and it has
room (``pool.RunnerPool``), or later through its tender (``tender.Tender``),
which claims work whose owner died or that nobody had room for. The holder
runs it (``runner.SessionRunner``) until the answer is complete, the session
ends, the lease is lost, or the replica shuts down and hands it back. The
schedule (a sorted set in Redis, written through the store) tells tenders
when to look at a session again; ``tend.lua`` decides on its own meta hash.
"""
