"""`python -m engine.kernels.build`: build (or load from the cache) the CPU kernels; exit 1 if
they cannot be built. `make install` runs it so the first replica start does not compile."""

from __future__ import annotations

import logging
import time

from engine.kernels import cpu_kernels


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    ok = cpu_kernels() is not None
    print(f"pdserve CPU kernels: {'ready' if ok else 'NOT built (see the warning above)'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
