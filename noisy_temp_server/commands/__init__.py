"""Subcommands of the `noisy-temp-server` CLI (see `noisy_temp_server.cli`)."""
