"""The gateway: the HTTP app (`http_app.build_app`, OpenAI-compatible + Coxswain routes) and
the gRPC front, each over an `EngineService`."""
