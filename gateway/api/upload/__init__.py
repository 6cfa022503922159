"""Mode A (RFC phase 2): a session's whole input as one streamed upload, its answer as the response."""
