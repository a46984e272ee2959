"""The HTTP front end: a thin adapter from KServe v2 over HTTP to the core."""
