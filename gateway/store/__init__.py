"""Session state in Redis: key names, Lua scripts and the store class."""
