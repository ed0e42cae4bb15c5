"""The OpenAI-compatible server in front of vLLM's AsyncLLM.

Modules (imported on demand, nothing happens on import of this package):

- `app`: `create_app(settings, engine, ...)` builds the `ServerState` and wires the routers,
  the middleware and the lifespan;
- `state`: `ServerState`, what every handler gets (engine, policy source, trace source, shadow
  scorer, metrics, settings, tokenizer, served model name);
- endpoint families, one router each: `completions` (`POST /v1/completions`), `chat`
  (`POST /v1/chat/completions`), `models` (`GET /v1/models`), `status` (`GET /v1/nts/status`),
  `health` (`GET /health`, `GET /metrics`);
- `serving`: what the two generation endpoints share: admission, the `n` choices on the
  engine, run to end, client disconnects; `streaming`: their server-sent events;
- `nts_summary`: the response's `nts` object from a choice's per-step T*;
- `auth`: the API key dependency of the `/v1/*` routes;
- `protocol`: request models, each converting itself to `SamplingParams`; `response_bodies`:
  the response models;
- `errors`: OpenAI error bodies and the exception handlers;
- `engine`: environment, engine arguments and `AsyncLLM` start (call
  `prepare_environment` before vLLM or prometheus_client are imported);
- `metrics`: API-side Prometheus metrics (injected registry; composes `online.metrics`) and
  the HTTP middleware.

The policy source, the shadow scorer and their metrics are `noisy_temp_server.online`'s.
"""
