"""The OpenAI-compatible server in front of vLLM's AsyncLLM.

Modules (imported on demand, nothing happens on import of this package):

- `protocol`: request/response models; each request converts itself to `SamplingParams`;
- `errors`: OpenAI error bodies and the exception handlers;
- `temperature`: policy in force + request keys -> engine keys and the `nts` summary;
- `app`: `create_app(settings, engine, ...)`, the FastAPI app;
- `engine`: environment, engine arguments and `AsyncLLM` start (call
  `prepare_environment` before vLLM or prometheus_client are imported);
- `metrics`: API-side Prometheus metrics (injected registry) and the HTTP middleware;
- `shadow`: the bounded-queue background shadow scorer feeding the online estimator.
"""
