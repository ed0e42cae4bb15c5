"""The contract between the API process and the engine process: the per-request ``nts_*`` keys
and their parser, the engine's environment, and the channel that carries traces back."""
