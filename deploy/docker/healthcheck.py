#!/usr/bin/env python3
"""Container health check: exit 0 if the local server's GET /health answers 200, else 1.

The port comes from `NTS_PORT` (default 8000), the same variable the server binds to. Uses
only the standard library, so it runs in any image that has the server's Python.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('NTS_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError as error:
        print(f"unhealthy: {url}: {error}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
