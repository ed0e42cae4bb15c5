"""The contract between the API process and the engine process.

- `keys`: every ``nts_*`` request key and every ``NTS_*`` engine variable, named once;
- `request_args`: the one parser of the request keys (the server and the engine);
- `engine_env`: the engine's configuration, written by the server and read by the engine;
- `bias_files`: where the engine finds per-token bias files (its bias directories), and
  loading one by its content hash (the engine and the online learner alike);
- `trace_wire`: the messages of the trace channel; `trace_sender`: its engine end;
  `trace_channel`: what the API process reads through it (`TraceSource`, `TraceReport`,
  `CapturedRows`; its API end, `TraceCollector`, is the server's: `server.trace_collector`).
"""
