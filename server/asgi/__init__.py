"""What every protocol on the HTTP port shares, beneath them all: how a protocol declares
itself to the port (`extension`), the watch for a client that leaves (`disconnect`), and the
reading of a declared body length (`lengths`). KServe v2 (`server/http`) and OpenAI's /v1
(`server/openai`) both build on it; it knows neither."""
