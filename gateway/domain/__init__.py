"""The session's domain: its states and legal transitions, and the start policies.

A leaf: it imports nothing else of the gateway, so the store (whose Lua
scripts inline the transition table), the engine work and the routers all
build on the same definitions.
"""
