"""What an HTTP request body may be: the gateway's defaults, importable without FastAPI
(the CLI's parser shows them)."""

# Bodies are JSON: prompts, vectors (a packed [num_layers, H] float32 vector of a large
# model is a few MB), patch entries. Larger is configurable (`max_body_bytes`).
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# 16 MiB in 10 s is 1.6 MB/s: any client that means to send its body does so well within
# it. Longer is configurable (`body_timeout_s`) for clients on slow links.
DEFAULT_BODY_TIMEOUT_S = 10.0
