"""The OpenAI front door: chat completions and models over the session machinery."""
